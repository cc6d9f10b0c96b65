"""The `accel` command line: argument mapping, script running, failure reports, end to end runs."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from accel.commands import cli, launch, launch_args, simulate
from accel.sim.devices import DEVICES
from accel.sim.runtime import output

ACCEL = str(Path(sys.executable).with_name("accel"))


def parse(*argv):
    return cli.build_parser().parse_args(["launch", *argv])


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "launch" in capsys.readouterr().out


def test_simulated_devices_match_the_simulator():
    assert launch.SIMULATED_DEVICES == DEVICES


def test_script_arguments_are_left_to_the_script():
    args = parse("--simulate", "xla", "--num_processes", "4", "train.py", "--num_processes", "7", "-x")
    assert (args.simulate, args.num_processes, args.script) == ("xla", 4, "train.py")
    assert args.script_args == ["--num_processes", "7", "-x"]
    # a script option that abbreviates several of ours (--tp: --tpu, --tpu_cluster, ...) is the script's
    args = parse("--simulate", "cuda", "train.py", "--tp", "8", "--num_proc", "2")
    assert args.script_args == ["--tp", "8", "--num_proc", "2"]


def test_single_machine_uses_a_standalone_torchrun():
    assert launch.torchrun_args(parse("--num_processes", "3", "t.py", "a")) == [
        "--nproc_per_node=3",
        "--standalone",
        "t.py",
        "a",
    ]
    argv = launch.torchrun_args(parse("--num_processes", "2", "--main_process_port", "1234", "t.py"))
    assert argv == [
        "--nproc_per_node=2",
        "--nnodes=1",
        "--node_rank=0",
        "--master_addr=127.0.0.1",
        "--master_port=1234",
        "t.py",
    ]


def test_multi_machine_options_map_to_torchrun():
    # As in Accelerate, --num_processes counts the processes of all machines.
    common = ["--num_processes", "8", "--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.1"]
    args = parse(*common, "--main_process_port", "29501", "t.py", "--lr", "1")
    assert launch.torchrun_args(args) == [
        "--nproc_per_node=4",
        "--nnodes=2",
        "--node_rank=1",
        "--rdzv_endpoint=10.0.0.1:29501",
        "t.py",
        "--lr",
        "1",
    ]
    args = parse(*common, "--main_process_port", "29501", "--same_network", "t.py")
    assert launch.torchrun_args(args)[3:5] == ["--master_addr=10.0.0.1", "--master_port=29501"]
    with pytest.raises(ValueError, match="main_process_ip"):
        launch.torchrun_args(parse("--num_machines", "2", "t.py"))
    with pytest.raises(ValueError, match="split evenly"):
        launch.torchrun_args(parse("--num_processes", "3", "--num_machines", "2", "t.py"))
    with pytest.raises(ValueError, match="machine_rank"):
        launch.torchrun_args(
            parse(
                "--num_machines",
                "2",
                "--machine_rank",
                "2",
                "--main_process_ip",
                "h",
                "--main_process_port",
                "1",
                "t.py",
            )
        )


def test_torchrun_options_pass_through():
    args = parse(
        "--num_processes", "2", "--max_restarts", "3", "--monitor_interval", "1.5", "--rdzv_backend", "c10d",
        "--rdzv_conf", "a=1", "--role", "trainer", "--log_dir", "logs", "--tee", "3",
        "--local_ranks_filter", "0", "-m", "pkg.train", "x",
    )  # fmt: skip
    assert launch.torchrun_args(args) == [
        "--nproc_per_node=2",
        "--standalone",
        "--rdzv_backend=c10d",
        "--rdzv_conf=a=1",
        "--max_restarts=3",
        "--monitor_interval=1.5",
        "--role=trainer",
        "--log_dir=logs",
        "--tee=3",
        "--local_ranks_filter=0",
        "--module",
        "pkg.train",
        "x",
    ]
    assert launch.torchrun_args(parse("--num_processes", "1", "--no_python", "prog"))[-2:] == ["--no_python", "prog"]


def test_accelerate_launch_flags_are_accepted_with_their_meaning():
    args = parse(
        "--multi_gpu", "--mixed_precision", "fp16", "--num_processes", "4", "--num_machines", "1",
        "--machine_rank", "0", "--main_process_ip", "127.0.0.1", "--main_process_port", "29500",
        "--gradient_accumulation_steps", "4", "--cpu", "--num_cpu_threads_per_process", "2", "--dynamo_backend", "no",
        "--same_network", "--rdzv_backend", "static", "--monitor_interval", "0.1", "--debug", "--gpu_ids", "0,1",
        "--config_file", "none.yaml", "-q", "t.py",
    )  # fmt: skip
    assert (args.multi_gpu, args.num_processes, args.gpu_ids, args.quiet, args.script) == (True, 4, "0,1", True, "t.py")
    assert launch.accel_env(args) == {
        "ACCEL_MIXED_PRECISION": "fp16",
        "ACCEL_USE_CPU": "1",
        "ACCEL_DEBUG_MODE": "1",
        "ACCEL_GRADIENT_ACCUMULATION_STEPS": "4",
        "OMP_NUM_THREADS": "2",
    }


def test_fsdp_flags_give_the_script_accelerates_environment(tmp_path):
    flags = [
        "--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
        "--fsdp_transformer_layer_cls_to_wrap", "Block", "--fsdp_state_dict_type", "FULL_STATE_DICT",
        "--fsdp_reshard_after_forward", "false", "--fsdp_activation_checkpointing", "true",
    ]  # fmt: skip
    env = launch.accel_env(parse(*flags, "t.py"))
    # what accelerate.utils.launch.prepare_multi_gpu_env sets for these flags (and its defaults for the others)
    assert {k: v for k, v in env.items() if k.startswith("FSDP_") or k == "ACCELERATE_USE_FSDP"} == {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
        "FSDP_RESHARD_AFTER_FORWARD": "false",
        "FSDP_OFFLOAD_PARAMS": "false",
        "FSDP_MIN_NUM_PARAMS": "100000000",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block",
        "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
        "FSDP_FORWARD_PREFETCH": "false",
        "FSDP_USE_ORIG_PARAMS": "true",
        "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
        "FSDP_SYNC_MODULE_STATES": "true",
        "FSDP_ACTIVATION_CHECKPOINTING": "true",
        "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false",
    }
    assert env["FSDP_VERSION"] == "2" and env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "Block"
    assert "ACCELERATE_USE_FSDP" not in launch.accel_env(parse("t.py"))
    config = tmp_path / "fsdp.yaml"
    config.write_text(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_state_dict_type: FULL_STATE_DICT\n"
    )
    args = parse("--config_file", str(config), "--fsdp_version", "2", "t.py")
    launch_args.apply_config_file(args)
    env = launch.accel_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_STATE_DICT_TYPE"] == "FULL_STATE_DICT"


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--use_deepspeed"], "--use_deepspeed: DeepSpeed is not supported"),
        (["--zero_stage", "2"], "--zero_stage: DeepSpeed"),
        (["--megatron_lm_tp_degree", "2"], "--megatron_lm_tp_degree: Megatron-LM is not supported"),
        (["--fp8_backend", "te"], "FP8"),
        (["--parallelism_config_tp_size", "2"], "ND parallelism"),
        (["--ipex"], "IPEX"),
        (["--use_npu"], "NPU"),
        (["--enable_cpu_affinity"], "CPU affinity"),
        (["--no_such_flag"], "unrecognized arguments: --no_such_flag"),
        (["--num_processes", "two"], "invalid int value"),
    ],
)
def test_bad_flags_show_the_launch_usage_and_say_what_is_wrong(flags, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["launch", *flags, "t.py"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: accel launch") and named in err


def test_dynamo_and_tpu_flags_we_cannot_honour_are_refused(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text("")
    assert cli.main(["launch", "--dynamo_backend", "inductor", str(script)]) == 2
    assert "does not compile models" in capsys.readouterr().err
    assert cli.main(["launch", "--tpu", str(script)]) == 2
    assert "--simulate xla" in capsys.readouterr().err
    assert cli.main(["launch", "--simulate", "cpu", "--no_python", str(script)]) == 2
    assert cli.main(["launch", "--fault", "kill:rank=0:collective=1", str(script)]) == 2
    assert "simulated runs only" in capsys.readouterr().err
    assert cli.main(["launch", "--simulate", "cpu", "--fault", "explode:rank=0", str(script)]) == 2
    assert "unknown fault action" in capsys.readouterr().err
    assert cli.main(["launch", "--simulate", "cpu", "--local_ranks_filter", "5", str(script)]) == 2
    assert "names no rank of 2" in capsys.readouterr().err


def test_an_accelerate_config_file_fills_in_what_the_command_line_left_out(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nmixed_precision: bf16\n"
        "num_processes: 4\nnum_machines: 1\nuse_cpu: true\ngpu_ids: all\nfsdp_config: {}\n"
    )
    args = parse("--config_file", str(config), "--num_processes", "2", "t.py")
    launch_args.apply_config_file(args)
    assert (args.mixed_precision, args.num_processes, args.cpu, args.gpu_ids) == ("bf16", 2, True, "all")
    config.write_text("distributed_type: DEEPSPEED\n")
    with pytest.raises(ValueError, match="DEEPSPEED is not supported"):
        launch_args.apply_config_file(parse("--config_file", str(config), "t.py"))
    with pytest.raises(ValueError, match="no such file"):
        launch_args.apply_config_file(parse("--config_file", str(tmp_path / "missing.yaml"), "t.py"))


def test_the_default_config_file_is_accelerates(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert launch_args.default_config_file() == str(tmp_path / "accelerate" / "default_config.yaml")
    args = parse("t.py")
    launch_args.apply_config_file(args)  # no default file: nothing changes
    assert args.mixed_precision is None
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "default_config.yaml").write_text("mixed_precision: fp16\n")
    launch_args.apply_config_file(args)
    assert args.mixed_precision == "fp16"


def test_exit_codes_of_processes():
    assert launch.process_exit_code(3) == 3
    assert launch.process_exit_code(-9) == 137  # killed by SIGKILL, as a shell says it
    assert launch.process_exit_code(None) == 1
    failures = {1: SimpleNamespace(kind="exit", exitcode=4), 0: SimpleNamespace(kind="exit", exitcode=5)}
    assert simulate.exit_code(failures) == 4  # the first listed: the likely cause
    assert simulate.exit_code({0: SimpleNamespace(kind="exception")}) == 1
    assert simulate.exit_code({0: SimpleNamespace(kind="signal", exitcode=-9)}) == 137


def test_accel_options_travel_as_environment_variables():
    env = launch.accel_env(parse("--mixed_precision", "bf16", "--cpu", "--debug", "t.py"))
    assert env == {"ACCEL_MIXED_PRECISION": "bf16", "ACCEL_USE_CPU": "1", "ACCEL_DEBUG_MODE": "1"}
    assert launch.accel_env(parse("t.py")) == {}
    env = launch.accel_env(parse("--tpu", "--mixed_precision", "bf16", "--downcast_bf16", "t.py"))
    assert env["XLA_DOWNCAST_BF16"] == "1"


def test_bad_invocations_are_refused(tmp_path, capsys):
    assert cli.main(["launch", str(tmp_path / "missing.py")]) == 2
    assert "no such script" in capsys.readouterr().err
    script = tmp_path / "s.py"
    script.write_text("")
    assert cli.main(["launch", "--num_processes", "0", str(script)]) == 2
    assert cli.main(["launch", "--num_machines", "2", str(script)]) == 2
    assert cli.main(["launch", "--simulate", "cpu", "--num_machines", "2", str(script)]) == 2
    assert "this machine only" in capsys.readouterr().err


def test_run_script_runs_main_with_its_argv(tmp_path, monkeypatch):
    (tmp_path / "helper.py").write_text("VALUE = 'from the script directory'\n")
    out = tmp_path / "out.txt"
    script = tmp_path / "s.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, sys, helper
        if __name__ == "__main__":
            open({str(out)!r}, "w").write(" ".join(sys.argv[1:]) + "|" + helper.VALUE + "|" + os.environ["ACCEL_X"])
            if sys.argv[1] != "0":
                sys.exit(int(sys.argv[1]))
    """)
    )
    monkeypatch.delenv("ACCEL_X", raising=False)
    argv, path = sys.argv[:], sys.path[:]
    simulate.run_script(str(script), ["0", "b"], {"ACCEL_X": "y"})
    assert out.read_text() == "0 b|from the script directory|y"
    assert sys.argv == argv and sys.path == path
    with pytest.raises(SystemExit) as exit_:  # the rank then ends with that code
        simulate.run_script(str(script), ["3"], {})
    assert exit_.value.code == 3
    sys.modules.pop("helper", None)


def test_failures_are_reported_once_per_rank_with_a_prefix():
    failures = {  # in the launcher's order: the likely cause first
        2: SimpleNamespace(
            kind="exception",
            traceback="Traceback (most recent call last):\n  boom\nValueError: x\n",
            exc_type="ValueError",
            message="x",
        ),
        0: SimpleNamespace(kind="signal", signal_name="SIGKILL"),
        1: SimpleNamespace(kind="exit", exitcode=3),
        3: SimpleNamespace(kind="timeout", stack="  File 'a.py', line 1, in wait"),
    }
    text = simulate.format_failures(failures, world_size=5, stopped={4: SimpleNamespace(kind="stopped")})
    lines = text.splitlines()
    assert lines[:3] == ["[rank 2] Traceback (most recent call last):", "[rank 2]   boom", "[rank 2] ValueError: x"]
    assert lines[3] == "[rank 0] killed by signal SIGKILL"
    assert lines[4] == "[rank 1] exited with code 3"
    assert lines[5].startswith("[rank 3] timed out") and lines[6] == "[rank 3]   File 'a.py', line 1, in wait"
    assert lines[7] == "[rank 4] stopped: still running after another rank had failed"
    assert lines[-1] == "accel launch: 4 of 5 ranks failed (rank 0, 1, 2, 3)"
    assert text.count("ValueError: x") == 1


def test_env_command_reports_versions_and_backends(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    # the columns widen with the longest name shown (an ACCEL_* variable set in the environment, say)
    assert re.search(r"^torch:\s+\S", out, re.M), out
    assert re.search(r"^Backends registered:\s+cpu, cuda, xla$", out, re.M), out
    assert re.search(r"^Backend selected:\s+cpu$", out, re.M), out


def _run(*argv, timeout=120):
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))
    }
    return subprocess.run([ACCEL, *argv], capture_output=True, text=True, timeout=timeout, env=env)


SCRIPT = """
import sys, torch
from accel.state import PartialState
state = PartialState()
total = state.hardware.all_reduce(torch.tensor([state.process_index + 1.0], device=state.device)).item()
print(f"rank {state.process_index}/{state.num_processes} {state.distributed_type} "
      f"cuda={torch.cuda.is_available()} total={total} args={sys.argv[1:]}", flush=True)
if "--fail" in sys.argv:
    state.wait_for_everyone()  # all have printed: the others are not stopped before their line (1 s grace)
    if state.process_index == 1:
        raise ValueError("rank one fails on purpose")
if "--accelerator" in sys.argv:
    from accel import Accelerator
    print(f"accumulation={Accelerator().gradient_accumulation_steps} threads={torch.get_num_threads()}", flush=True)
if "--exit3" in sys.argv and state.process_index == 1:
    sys.exit(3)
if "--exit0" in sys.argv:
    sys.exit(0)
if "--destroy" in sys.argv:
    state.wait_for_everyone()
    state.destroy_process_group()  # a clean exit under torchrun: no Gloo threads left at teardown
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return str(path)


def test_launch_without_simulate_runs_torchrun(script):
    done = _run("launch", "--num_processes", "2", script, "--destroy")
    assert done.returncode == 0, done.stderr
    for rank in range(2):
        assert f"rank {rank}/2 MULTI_CPU cuda=False total=3.0 args=['--destroy']" in done.stdout


def test_simulated_launch_runs_the_script_on_every_rank(script, capsys):
    # In this process (the ranks are still fresh ones), to spare a torch import.
    code = cli.main(
        ["launch", "--simulate", "xla", "--num_processes", "2", "--mixed_precision", "bf16", script, "--exit0", "b"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    for rank in range(2):
        assert f"[rank {rank}] rank {rank}/2 XLA cuda=False total=3.0 args=['--exit0', 'b']" in out


def test_launch_flags_reach_the_accelerator_in_simulated_ranks(script, capsys):
    argv = ["--simulate", "cpu", "--gradient_accumulation_steps", "3", "--num_cpu_threads_per_process", "1"]
    code = cli.main(["launch", *argv, "--local_ranks_filter", "1", script, "--accelerator"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "accumulation=3 threads=1\n" in out
    assert "[rank" not in out  # one rank shown: no prefix
    assert "rank 0/2" not in out  # the other rank's output is filtered out
    assert output.settings() == output.OutputSettings()  # the filter ended with the launch


def test_simulated_launch_reports_the_failing_rank_once(script, capsys):
    code = cli.main(["launch", "--simulate", "cuda", "--num_processes", "3", script, "--fail"])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert "rank 0/3 MULTI_GPU cuda=True total=6.0" in out
    assert err.count("ValueError: rank one fails on purpose") == 1
    assert "[rank 1] ValueError: rank one fails on purpose" in err
    assert f'[rank 1]   File "{script}", line' in err
    assert "runpy" not in err
    assert "accel launch: 1 of 3 ranks failed (rank 1)" in err


def test_a_module_runs_with_dash_m(tmp_path, monkeypatch, capsys):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(
        "import os, sys\n"
        "if __name__ == '__main__':\n"
        "    print('module', os.environ['RANK'], sys.argv[1:], flush=True)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert cli.main(["launch", "--simulate", "cpu", "-m", "pkg.train", "x"]) == 0
    out = capsys.readouterr().out
    assert "[rank 0] module 0 ['x']" in out and "[rank 1] module 1 ['x']" in out
