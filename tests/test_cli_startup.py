"""The CLI answers ``--help`` and argument errors without importing torch (the engine loads on first use)."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_cli_help_does_not_import_torch():
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom harness.cli import app\n"
            "r = CliRunner().invoke(app, ['--help'])\nassert r.exit_code == 0, r.output\n"
            "r = CliRunner().invoke(app, ['bench', '--bogus-option'])\nassert r.exit_code == 2, r.output\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "import engine\nassert 'torch' not in sys.modules\n"
            "from engine import LLM\nassert 'torch' in sys.modules\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_generate_refuses_bad_prompts_before_loading(tiny_model_dir, monkeypatch):
    """An empty or over-long prompt is refused from the tokenizer and config alone: no engine is built."""
    import engine
    from typer.testing import CliRunner
    from harness.cli import app

    def no_engine(*a, **kw):
        raise AssertionError("the engine was built for a bad prompt")
    monkeypatch.setattr(engine, "LLM", no_engine)
    base = ["generate", "--model", str(tiny_model_dir), "--no-spec", "--device", "cpu"]
    r = CliRunner().invoke(app, base[:1] + [""] + base[1:])
    assert r.exit_code == 2 and "prompt 0: empty prompt" in r.output, r.output
    r = CliRunner().invoke(app, base[:1] + ["word " * 5000] + base[1:] + ["--set", "max_model_len=64"])
    assert r.exit_code == 2 and "longer than the context (64 tokens)" in r.output, r.output
    r = CliRunner().invoke(app, base[:1] + ["hi"] + base[1:] + ["--temperature", "nan"])
    assert r.exit_code == 2 and "temperature" in r.output, r.output


def test_console_script_runs_main_with_the_signal_handlers():
    """The installed ``ppspec`` must enter ``harness.cli.main`` (which installs the SIGINT / SIGTERM handlers and
    prints the one-line interruption), not the bare Typer app: an entry point on ``app`` exited 130 silently and
    died by SIGTERM with leaked-semaphore warnings."""
    import tomllib
    from importlib.metadata import entry_points
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["ppspec"] == "harness.cli:main"
    import harness.cli
    installed = [e for e in entry_points(group="console_scripts") if e.name == "ppspec"]
    if installed:                                      # the package as pip installed it (CI: pip install -e .)
        assert installed[0].load() is harness.cli.main


def test_interrupt_surfacing_as_another_exception_ends_with_the_interrupt_line(monkeypatch, capsys):
    """A SIGINT that lands inside a library's import can surface as that library's own error (ImportError,
    RuntimeError) rather than the Interrupted the handler raised: main still ends with the one interrupt line and
    exit 130, no traceback."""
    import signal

    import pytest

    import harness.cli as cli

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
