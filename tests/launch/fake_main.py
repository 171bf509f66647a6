"""The start every stand-in for main.py in the sweep tests shares: its workdir, its
``--config.k=v`` overrides as ``over``, and a line saying how it was called."""

HEAD = '''
import json, pathlib, sys
args = sys.argv[1:]
workdir = pathlib.Path(args[args.index("--workdir") + 1])
over = dict(a[len("--config."):].split("=", 1) for a in args if a.startswith("--config."))
workdir.mkdir(parents=True, exist_ok=True)
print("fake main.py:", " ".join(args), flush=True)
'''


def install(tmp_path, monkeypatch, body: str):
    """``body`` as ``tmp_path/fake_main.py``, the script the sweep's trials run; its path."""
    from meshrl.launch import sweep_trials

    path = tmp_path / "fake_main.py"
    path.write_text(body)
    monkeypatch.setattr(sweep_trials, "MAIN", path)
    return path
