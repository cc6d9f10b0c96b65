"""The Transformers Trainer on a small GPT-2 built from a config (nothing downloaded).

Trains one epoch, evaluates, saves, and prints one `RESULT {...}` line (JSON) from the
main process. Run it under `accel launch --simulate cuda` (or cpu); `--precision` is
fp32, bf16 or fp16.
"""

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--precision", default="fp32")
parser.add_argument("--out", required=True)
parser.add_argument("--batch", type=int, default=4, help="per device")
args = parser.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, index):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


torch.manual_seed(0)
# no dropout: a GPU draws its masks from its own generator, so runs on GPU and CPU are compared without it
config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
model = GPT2LMHeadModel(config)
training = TrainingArguments(
    output_dir=args.out,
    per_device_train_batch_size=args.batch,
    per_device_eval_batch_size=args.batch,
    num_train_epochs=1,
    logging_steps=1,
    report_to=[],
    save_strategy="no",
    bf16=args.precision == "bf16",
    fp16=args.precision == "fp16",
    disable_tqdm=True,
)
trainer = Trainer(model=model, args=training, train_dataset=Tokens(), eval_dataset=Tokens())
trained = trainer.train()
metrics = trainer.evaluate()
final = os.path.join(args.out, "final")
trainer.save_model(final)
if trainer.is_world_process_zero():
    result = {
        "device": str(training.device),
        "world_size": training.world_size,
        "n_gpu": training.n_gpu,
        "model_class": type(trainer.model_wrapped).__name__,
        "parallel_mode": str(training.parallel_mode),
        "train_loss": trained.training_loss,
        "eval_loss": metrics["eval_loss"],
        "param_device": str(next(trainer.model.parameters()).device),
        "saved": sorted(os.listdir(final)),
    }
    print("RESULT " + json.dumps(result))
