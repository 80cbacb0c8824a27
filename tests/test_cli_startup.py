"""The CLI answers ``--help`` and argument errors without importing torch (the engine loads on first use)."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_cli_help_does_not_import_torch():
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom harness.cli.app import app\n"
            "r = CliRunner().invoke(app, ['--help'])\nassert r.exit_code == 0, r.output\n"
            "r = CliRunner().invoke(app, ['bench', '--bogus-option'])\nassert r.exit_code == 2, r.output\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "import engine\nassert 'torch' not in sys.modules\n"
            "from engine import LLM\nassert 'torch' in sys.modules\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_generate_refuses_bad_prompts_before_loading(tiny_model_dir, monkeypatch):
    """An empty, over-long or non-Unicode prompt is refused from the tokenizer and config alone: no engine is built.
    The one prompt of generate is "the prompt" (the engine's messages carry an index, for calls of several)."""
    import engine
    from typer.testing import CliRunner
    from harness.cli.app import app

    def no_engine(*a, **kw):
        raise AssertionError("the engine was built for a bad prompt")
    monkeypatch.setattr(engine, "LLM", no_engine)
    base = ["generate", "--model", str(tiny_model_dir), "--no-spec", "--device", "cpu"]
    r = CliRunner().invoke(app, base[:1] + [""] + base[1:])
    assert r.exit_code == 2 and r.output.strip() == "Error: the prompt is empty", r.output
    r = CliRunner().invoke(app, base[:1] + ["word " * 5000] + base[1:] + ["--set", "max_model_len=64"])
    assert r.exit_code == 2 and r.output.strip().startswith("Error: the prompt of "), r.output
    assert r.output.strip().endswith(" tokens is longer than the context (64 tokens)"), r.output
    r = CliRunner().invoke(app, base[:1] + ["a\udcffb"] + base[1:])       # undecodable argv bytes: a lone surrogate
    assert r.exit_code == 2 and r.output.strip() == (
        "Error: the prompt: text is not valid Unicode (character 1 cannot be encoded as UTF-8)"), r.output
    r = CliRunner().invoke(app, base[:1] + ["hi"] + base[1:] + ["--temperature", "nan"])
    assert r.exit_code == 2 and "temperature" in r.output, r.output


def test_console_script_runs_main_with_the_signal_handlers():
    """The installed ``ppspec`` must enter ``harness.entry.main`` (which holds SIGINT / SIGTERM while the CLI imports,
    then runs ``harness.cli.app.main``: its handlers, the one-line interruption), not the bare Typer app: an entry point
    on ``app`` exited 130 silently and died by SIGTERM with leaked-semaphore warnings."""
    import tomllib
    from importlib.metadata import entry_points
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["ppspec"] == "harness.entry:main"
    import harness.entry
    installed = [e for e in entry_points(group="console_scripts") if e.name == "ppspec"]
    if installed:                                      # the package as pip installed it (CI: pip install -e .)
        assert installed[0].load() is harness.entry.main


def test_entry_point_imports_only_signal_before_the_cli():
    """The window under Python's default SIGINT handler is the interpreter's start only: importing the entry point
    (and the harness package) pulls in no third-party module and not harness.cli.app."""
    code = ("import sys\nbefore = set(sys.modules)\nimport harness.entry\n"
            "new = set(sys.modules) - before\nassert new <= {'harness', 'harness.entry', 'signal'}, new\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]


def test_sigint_while_the_cli_imports_ends_with_the_interrupt_line(tmp_path):
    """Regression: a Ctrl-C in the first second of a command (while Typer, Rich and the command modules import,
    before harness.cli.app installed its handler) ended with Python's KeyboardInterrupt traceback. The entry point holds
    it; the CLI then ends at once with the one line and 130, running no command (``--help`` prints nothing)."""
    script = tmp_path / "run_entry.py"
    script.write_text(
        "import builtins, os, signal, sys\n"
        "import harness.entry\n"
        "real = builtins.__import__\n"
        "def imp(name, globals=None, locals=None, fromlist=(), level=0):\n"
        "    if name == 'harness.cli' and fromlist and 'app' in fromlist and 'harness.cli.app' not in sys.modules:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(name, globals, locals, fromlist, level)\n"
        "builtins.__import__ = imp\n"
        "sys.argv = ['ppspec', '--help']\n"
        "harness.entry.main()\n")
    p = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 130, (p.stdout, p.stderr[-2000:])
    assert p.stderr == "ppspec: interrupted (SIGINT)\n" and p.stdout == "", (p.stdout, p.stderr)


def test_interrupt_surfacing_as_another_exception_ends_with_the_interrupt_line(monkeypatch, capsys):
    """A SIGINT that lands inside a library's import can surface as that library's own error (ImportError,
    RuntimeError) rather than the Interrupted the handler raised: main still ends with the one interrupt line and
    exit 130, no traceback."""
    import signal

    import pytest

    import harness.cli.app as cli

    def command():                       # the handler's Interrupted swallowed, another error raised after it
        try:
            cli._on_signal(signal.SIGINT, None)
        except cli.Interrupted:
            pass
        raise RuntimeError("duplicate registrations for aten.linspace.Tensor_Tensor")

    monkeypatch.setattr(cli, "app", lambda prog_name: command())
    monkeypatch.setattr(cli, "_signalled", [])
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as ex:
            cli.main()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    assert ex.value.code == 130
    err = capsys.readouterr().err
    assert "ppspec: interrupted (SIGINT)" in err and "Traceback" not in err and "duplicate" not in err

    monkeypatch.setattr(cli, "app", lambda prog_name: (_ for _ in ()).throw(RuntimeError("plain failure")))
    monkeypatch.setattr(cli, "_signalled", [])
    try:
        with pytest.raises(RuntimeError, match="plain failure"):       # no signal: the error is not hidden
            cli.main()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _run_main(tmp_path, command_src: str, watchdog_s: float | None = None):
    """Run ``harness.cli.app.main`` in a child process with the Typer app replaced by ``command()`` (defined by
    ``command_src``, with os, signal and time imported and ``tmp_path`` on sys.path); returns the CompletedProcess.
    The timeout only bounds a hang."""
    script = tmp_path / "run_main.py"
    script.write_text("import os, signal, sys, time\n"
                      f"sys.path.insert(0, {str(tmp_path)!r})\n"
                      "import harness.cli.app as cli\n"
                      + (f"cli.WATCHDOG_S = {watchdog_s}\n" if watchdog_s is not None else "")
                      + command_src
                      + "cli.app = lambda prog_name: command()\nsys.argv = ['ppspec']\ncli.main()\n")
    return subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_sigint_during_an_import_takes_effect_when_the_import_returns(tmp_path):
    """Regression: a SIGINT landing inside a library's import (torch, triton) raised there; a library that caught it
    left the handler's SIG_IGN behind and the command ran on (only SIGKILL stopped it), or the interpreter crashed at
    exit on the half-imported module. The signal is now held until the outermost import returns: the module is
    imported whole (its own ``except BaseException`` sees nothing), then the command ends with the one line, 130."""
    (tmp_path / "swallowing_mod.py").write_text(
        "import os, signal\n"
        "try:\n    os.kill(os.getpid(), signal.SIGINT)\n    for _ in range(100000):\n        pass\n"
        "except BaseException:\n    print('swallowed', flush=True)\n"
        "DONE = True\n")
    p = _run_main(tmp_path, "def command():\n"
                            "    import swallowing_mod\n"
                            "    print('after the import', flush=True)\n"
                            "    time.sleep(60)\n")
    assert p.returncode == 130, (p.stdout, p.stderr[-2000:])
    assert p.stderr == "ppspec: interrupted (SIGINT)\n" and p.stdout == "", (p.stdout, p.stderr)


def test_a_swallowed_interrupt_is_delivered_again(tmp_path):
    """An Interrupted that some code catches and drops outside an import: the watchdog delivers the signal again
    (raised where the command is then), so the command still ends with the one line and 130; code that swallows
    every one is ended at once, with the same line and code."""
    p = _run_main(tmp_path, "def command():\n"
                            "    try:\n        os.kill(os.getpid(), signal.SIGINT)\n        time.sleep(60)\n"
                            "    except BaseException:\n        print('swallowed', flush=True)\n"
                            "    time.sleep(60)\n", watchdog_s=0.5)
    assert p.returncode == 130 and p.stdout == "swallowed\n", (p.stdout, p.stderr[-2000:])
    assert p.stderr == "ppspec: interrupted (SIGINT)\n"
    p = _run_main(tmp_path, "def command():\n"
                            "    kill = True\n"
                            "    while True:\n"
                            "        try:\n"
                            "            if kill:\n                kill = False\n"
                            "                os.kill(os.getpid(), signal.SIGINT)\n"
                            "            time.sleep(60)\n"
                            "        except BaseException:\n            print('swallowed', flush=True)\n",
                  watchdog_s=0.5)
    assert p.returncode == 130 and p.stdout == "swallowed\nswallowed\n", (p.stdout, p.stderr[-2000:])
    assert p.stderr == "ppspec: interrupted (SIGINT)\n"


def _sigterm_caught(pid: int) -> bool:
    """Whether process ``pid`` catches SIGTERM (``SigCgt`` of /proc/PID/status): the interpreter does not, so this
    turns true when :func:`harness.entry.main`'s first line has run."""
    import signal
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _interrupt_generate(model: str, delay_s: float, *, after_entry: bool, extra: tuple[str, ...] = ()):
    """Start ``python -m harness generate`` on ``model`` and send it SIGINT ``delay_s`` seconds after it started
    (``after_entry``: after its entry point installed its handlers). Returns (returncode, stdout, stderr, the
    descendants seen during start-up still running afterwards, :func:`_still_running`)."""
    import signal
    import time

    import psutil
    cmd = [sys.executable, "-m", "harness", "generate", "hello", "--model", model, "--device", "cpu",
           "--max-new-tokens", "2000", "--set", "max_model_len=4096", *extra]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[int, psutil.Process] = {}
    t0 = time.monotonic()
    while after_entry and not _sigterm_caught(p.pid) and time.monotonic() - t0 < 60 and p.poll() is None:
        time.sleep(0.005)
    t0 = time.monotonic()
    while time.monotonic() - t0 < delay_s and p.poll() is None:
        try:
            for c in psutil.Process(p.pid).children(recursive=True):
                seen.setdefault(c.pid, c)
        except psutil.Error:
            pass
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    return p.returncode, out, err, _still_running(seen.values(), ORPHAN_GRACE_S)


def _empty_or_streamed(stdout: str) -> bool:
    """What an interrupted ``generate`` may leave on stdout: nothing (the signal came during start-up), or the tokens
    it had streamed, closed by one newline (a fast machine loads the tiny model before the signal). Never a
    traceback or the closing summary line, which goes to stderr."""
    return stdout == "" or (stdout.endswith("\n") and "Traceback" not in stdout)


ORPHAN_GRACE_S = 10.0   # how long a descendant seen during start-up may take to finish exiting after the front end


def _still_running(procs, grace_s: float) -> list[str]:
    """Which of ``procs`` (psutil.Process objects: the same process, not a reused pid) are still running after up to
    ``grace_s`` seconds, as ``"pid status cmdline"``. A zombie or dead entry counts as gone: the front end has
    exited, so reaping is its new parent's job, and a process torn down by the kernel passes through both states.
    The grace covers that teardown on a loaded machine, not a rank that keeps computing: a rank has
    PR_SET_PDEATHSIG and the front end reaps its ranks before it exits."""
    import time

    import psutil

    def running(q) -> bool:
        try:
            return q.is_running() and q.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
        except psutil.Error:
            return False

    deadline = time.monotonic() + grace_s
    left = [q for q in procs if running(q)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [q for q in left if running(q)]
    out = []
    for q in left:
        try:
            out.append(f"{q.pid} {q.status()} {' '.join(q.cmdline())[:200]}")
        except psutil.Error:
            pass
    return out


@pytest.mark.parametrize("delay_s", [0.0, 0.3, 1.0, 2.0, 3.5])
def test_sigint_at_any_point_of_start_up_exits_130_with_one_line(tiny_model_dir, delay_s):
    """Regression: a Ctrl-C in the first seconds of a command (while torch and triton import) could be swallowed
    (the command ran on) or crash the interpreter. From the entry point's first line on, SIGINT at any point of
    start-up (the CLI's imports, torch's, the engine's start at pp=2) ends the command with exit 130, the one
    interrupt line on stderr, no traceback, nothing on stdout, and no rank process left behind."""
    rc, out, err, alive = _interrupt_generate(str(tiny_model_dir), delay_s, after_entry=True,
                                              extra=("--no-spec", "--pp", "2"))
    assert rc == 130, (rc, out, err[-2000:])
    assert err.startswith("ppspec: interrupted (SIGINT)") and err.count("\n") == 1, err[-2000:]
    assert _empty_or_streamed(out) and not alive, (out, alive)


@pytest.mark.parametrize("at_s", ["1", "3.5"])
def test_timeout_sigint_in_the_first_seconds(tiny_model_dir, at_s):
    """The issue's own check: ``timeout -s INT <t> python -m harness generate ...`` at a point inside the first
    seconds exits 130 with the one interrupt line (``--preserve-status``: the command's own exit code)."""
    import shutil
    if shutil.which("timeout") is None:
        pytest.skip("no timeout(1)")
    p = subprocess.run(["timeout", "--preserve-status", "-s", "INT", at_s, sys.executable, "-m", "harness",
                        "generate", "hello", "--model", str(tiny_model_dir), "--device", "cpu", "--no-spec",
                        "--max-new-tokens", "2000", "--set", "max_model_len=4096"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 130, (p.returncode, p.stdout, p.stderr[-2000:])
    assert p.stderr.startswith("ppspec: interrupted (SIGINT)") and p.stderr.count("\n") == 1, p.stderr[-2000:]
    assert _empty_or_streamed(p.stdout), p.stdout[-2000:]


def test_max_new_tokens_past_the_context_is_capped_with_a_notice_up_front(tiny_model_dir):
    """Regression: a huge --max-new-tokens was capped at the context silently (a log line only once the model had
    loaded) and ran for minutes. The front end says so first, in one line naming the cap, then serves the request
    at the cap (the engine's own clamp warning is not repeated); the closing line says the context stopped it."""
    p = subprocess.run([sys.executable, "-m", "harness", "generate", "hi", "--model", str(tiny_model_dir), "--device",
                        "cpu", "--no-spec", "--max-new-tokens", "100000000", "--set", "max_model_len=48"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    from engine.model.loader import load_tokenizer
    n = len(load_tokenizer(tiny_model_dir).encode("hi", add_special_tokens=False))
    assert p.stderr.splitlines() == [
        f"Note: --max-new-tokens 100000000 is capped at {48 - n} tokens: the context length 48 minus the prompt's {n}",
        f"[{48 - n} tokens, length, stopped by the context length]"], p.stderr
