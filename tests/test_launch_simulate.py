"""`accel launch --simulate` end to end: live output, progress bars, exit codes, Ctrl-C, restarts.

The launcher runs as a user runs it (a subprocess in a session of its own, as a terminal
would start it) where the behaviour depends on being a real process: live pipes,
SIGINT, the exit status. After each run, nothing it started may still be running.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from accel.commands import cli

pytestmark = pytest.mark.processes  # each test is a whole `accel launch` process: make test-frameworks runs it

ACCEL = str(Path(sys.executable).with_name("accel"))
EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "train_resumable.py")


def _env():
    return {
        k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))
    }


def _start(*argv, cwd):
    # A session of its own, as a shell starts a job: Ctrl-C goes to its whole process group.
    return subprocess.Popen(
        [ACCEL, "launch", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),  # bytes, not text: text mode would turn the bars' "\r" into "\n"
        cwd=cwd,
        start_new_session=True,
    )


def _session_processes(session: int) -> list[str]:
    """Live processes of a session (zombies count as gone)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[3]) == session:
            try:
                command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                command = ""
            found.append(f"{entry} {command}")
    return found


def _assert_nothing_left(session: int) -> None:
    deadline = time.monotonic() + 10
    while _session_processes(session) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session_processes(session) == [], "processes of the launch still running"


def _assert_gone(pids) -> None:
    deadline = time.monotonic() + 10
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                break
            time.sleep(0.1)
        else:
            continue
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)]
    assert alive == [], f"ranks {alive} still running"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"


LIVE = """
import os, sys, time
from pathlib import Path
from tqdm import tqdm

rank = int(os.environ["RANK"])
go = Path(sys.argv[1])
print(f"pid {os.getpid()}", flush=True)
if rank == 0:
    print("first", flush=True)
    deadline = time.monotonic() + 60
    while not go.exists():  # the test creates it once it has seen "first"
        if time.monotonic() > deadline:
            sys.exit("the test never saw the first line")
        time.sleep(0.02)
    for _ in tqdm(range(3), mininterval=0, ncols=40):
        pass
    print("last", flush=True)
"""


def test_lines_stream_live_and_progress_bars_redraw_in_place(tmp_path):
    (tmp_path / "live.py").write_text(LIVE)
    go = tmp_path / "go"
    proc = _start("--simulate", "cpu", "--num_processes", "2", "live.py", str(go), cwd=tmp_path)
    try:
        seen = []
        for raw in proc.stdout:
            line = raw.decode()
            seen.append(line)
            if line == "[rank 0] first\n":
                break
        # rank 0 is still running, waiting for us: its first line came live
        assert seen and seen[-1] == "[rank 0] first\n", seen
        assert proc.poll() is None
        go.touch()
        # Not communicate(): it would skip what the line iteration above has buffered.
        rest, err = proc.stdout.read().decode(), proc.stderr.read().decode()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    out = "".join(seen) + rest
    assert proc.returncode == 0, err
    assert out.index("[rank 0] first\n") < out.index("[rank 0] last\n")
    pids = [int(line.split()[-1]) for line in out.splitlines() if " pid " in line]
    assert len(pids) == 2
    # each update of the bar is drawn again behind its prefix, not glued to one line at the end
    assert err.count("\r[rank 0] ") >= 4, repr(err)
    assert "\r[rank 0]  33%|" in err and "\r[rank 0] 100%|" in err
    assert "leaked semaphore" not in err
    _assert_gone(pids)
    _assert_nothing_left(proc.pid)


SLEEPER = """
import os, time
print(f"pid {os.getpid()}", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize(
    ("signum", "words"),
    [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated")],
    ids=["ctrl-c", "sigterm"],
)
def test_ctrl_c_stops_every_rank_and_says_so_in_one_line(tmp_path, signum, words):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    proc = _start("--simulate", "cuda", "--num_processes", "2", "sleeper.py", cwd=tmp_path)
    try:
        pids = []
        for raw in proc.stdout:
            line = raw.decode()
            if " pid " in line:
                pids.append(int(line.split()[-1]))
            if len(pids) == 2:
                break
        assert len(pids) == 2
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)  # what the terminal does on Ctrl-C: the whole foreground group
        else:
            os.kill(proc.pid, signum)  # what a job scheduler does
        err = proc.communicate(timeout=60)[1].decode()
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, err
    assert err == f"accel launch: {words}; stopped all 2 ranks\n"
    _assert_gone(pids)
    _assert_nothing_left(proc.pid)


def test_the_exit_code_is_the_first_failing_ranks(tmp_path):
    (tmp_path / "exits.py").write_text(
        textwrap.dedent("""
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(30)  # stopped once rank 1 has failed
    """)
    )
    proc = _start("--simulate", "xla", "--num_processes", "3", "exits.py", cwd=tmp_path)
    try:
        err = proc.communicate(timeout=120)[1].decode()
    finally:
        proc.kill()
    assert proc.returncode == 3, err
    assert "[rank 1] exited with code 3" in err
    _assert_nothing_left(proc.pid)


def test_a_run_killed_mid_epoch_restarts_and_ends_with_the_uninterrupted_weights(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    plain, restarted, failed = tmp_path / "plain", tmp_path / "restarted", tmp_path / "failed"
    assert cli.main(["launch", "--simulate", "cpu", EXAMPLE, "--output_dir", str(plain), "--epochs", "1"]) == 0
    capsys.readouterr()

    fault = ["--fault", "kill:rank=1:point=step_7"]  # after step 7; the last checkpoint is step 5
    code = cli.main(
        [
            "launch",
            "--simulate",
            "cpu",
            "--max_restarts",
            "1",
            *fault,
            EXAMPLE,
            "--output_dir",
            str(restarted),
            "--epochs",
            "1",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "[rank 1] killed by signal SIGKILL" in err
    assert "accel launch: restarting all 2 ranks (restart 1 of 1)" in err
    assert f"attempt 1: resuming from {restarted}/step_5 (step 5)" in out  # TORCHELASTIC_RESTART_COUNT=1
    expected = torch.load(plain / "final.pt")
    got = torch.load(restarted / "final.pt")
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name

    # Without a restart, the run ends with the killed rank's status: 128 + SIGKILL.
    code = cli.main(["launch", "--simulate", "cpu", *fault, EXAMPLE, "--output_dir", str(failed), "--epochs", "1"])
    assert code == 128 + signal.SIGKILL
    assert not (failed / "final.pt").exists()


RICH = """
import os, sys, time
from pathlib import Path
from rich.progress import track

go = Path(sys.argv[1])
for step in track(range(3), description="work"):
    if step == 1:  # the test creates it once it has seen the bar at 33% on its terminal
        deadline = time.monotonic() + 60
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
print("done", flush=True)
"""


def test_rich_progress_renders_live_on_a_terminal(tmp_path):
    pytest.importorskip("rich")
    pty = pytest.importorskip("pty")
    (tmp_path / "bar.py").write_text(RICH)
    go = tmp_path / "go"
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [ACCEL, "launch", "--simulate", "cpu", "--num_processes", "2", "bar.py", str(go)],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env=_env(),
        cwd=tmp_path,
        start_new_session=True,
    )
    os.close(slave)
    screen = b""
    try:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed: the launcher has exited
                break
            if not chunk:
                break
            screen += chunk
            if b" 33%" in screen and not go.exists():
                go.touch()  # the bar moved while the rank was still running: it renders live
        proc.wait(timeout=60)
    finally:
        os.close(master)
        proc.kill()
    text = screen.decode(errors="replace")
    assert proc.returncode == 0, text
    assert go.exists(), text
    # rich redraws its line ("\r", erase line) and the prefix comes after the erase code
    assert text.count("\r\x1b[2K[rank 0] work") >= 2, repr(text)
    assert "[rank 1] done" in text
    _assert_nothing_left(proc.pid)


def test_ctrl_c_while_the_ranks_start_is_one_line_too(tmp_path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    proc = _start("--simulate", "cpu", "--num_processes", "2", "sleeper.py", cwd=tmp_path)
    try:
        # As soon as the fork server exists (it then imports torch for seconds), before any rank ran.
        deadline = time.monotonic() + 60
        while not any("forkserver" in line for line in _session_processes(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, "no fork server started"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = (stream.decode() for stream in proc.communicate(timeout=60))
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert err == "accel launch: interrupted; stopped all 2 ranks\n"
    assert " pid " not in out
    _assert_nothing_left(proc.pid)
