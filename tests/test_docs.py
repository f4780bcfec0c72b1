"""The user's pages hold: the README is short and its commands run as written, and the
architecture page names every folder of the library and only folders that exist.

Every shell command in the README's code blocks is listed here once: run by the default
tier (`QUICK`), run by the slow tier (`SLOW`, in tests/slow.txt), or not run, with the
reason (`NOT_RUN`). A command added to the README without a place here fails the test, as
does a listed command the README no longer has.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
README = REPO / "README.md"
ARCHITECTURE = REPO / "docs" / "architecture.md"

QUICK = (
    'jaxdec generate --prompt "Once upon a time" --max-new-tokens 64',
    'jaxdec generate --chat --prompt "Explain RoPE" --temperature 0.7 --top-p 0.9 --seed 1',
    "jaxdec info qwen2.5-coder-0.5b",
    "jaxdec fetch qwen2.5-coder-0.5b",
    "jaxdec fetch gemma3-270m",
    "jaxdec fetch corpora",
)

# in this order: a command may use what an earlier one wrote (the GPTQ checkpoint)
SLOW = (
    "jaxdec convert smollm2 checkpoints/smollm2-orbax --dtype bfloat16",
    "jaxdec eval ppl --model smollm2 --corpus prose",
    "jaxdec quantize smollm2 checkpoints/smollm2-gptq4 --method gptq --bits 4 --group 64",
    'jaxdec generate --model checkpoints/smollm2-gptq4 -p "The capital of France is"',
    "jaxdec quantize smollm2 checkpoints/smollm2-Q4_K_M.gguf --method Q4_K_M",
    "jaxdec compress-lossless smollm2 checkpoints/smollm2-df11",
    'jaxdec generate --draft layers:8 -p "Once upon a time"',
    "jaxdec generate --model qwen2.5-coder-0.5b --draft smollm2 --draft-method slem "
    '--draft-weights int4 --chat -p "Write a Python function that reverses a list"',
    'python scripts/launch_multihost.py -n 2 -- jaxdec generate --mesh data=2 -p "Once upon a time"',
)

SERVE = "jaxdec serve --model smollm2 --port 8000"
CURL = ("curl http://127.0.0.1:8000/v1/completions -H \"Content-Type: application/json\" -d "
        "'{\"model\": \"smollm2\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16}'")

NOT_RUN = {
    "make demo": "the README's setup; CI runs `make test`, which builds on it",
    "make test": "CI itself",
    "jaxdec chat --model qwen2.5-coder-0.5b": "interactive; tests/test_cli.py::test_chat_is_multi_turn "
                                              "drives `jaxdec chat` through stdin",
    "jaxdec distill --target smollm2 --drafter eagle3 --out runs/eagle3 --steps 2400 --lr 1e-3 "
    "--n-prompts 2048 --n-new 96 --gen-batch 32 --k 5 --unroll 3 --draft-vocab 4096 --d-ff 768":
        "45 minutes of training; tests/test_train.py and tests/test_eagle3.py run it at small sizes",
    'jaxdec generate --draft runs/eagle3/drafter --draft-tree 4,4,12 -p "Once upon a time"':
        "needs the distill run above; tests/test_eagle3.py decodes trees from a trained drafter",
    "jaxdec bench --weights f32,gguf --peers hf,llama.cpp --batches 1,8,32,64 --json report.json":
        "about 20 minutes; tests/test_bench_scripts.py runs the bench at small sizes",
    SERVE: "a server: test_readme_server_examples_work_as_written starts it, then runs the curl",
    CURL: "needs the server: test_readme_server_examples_work_as_written runs it against one",
}


def _blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def readme_commands() -> list[str]:
    out = []
    for lang, body in _blocks(README.read_text()):
        if lang in ("", "bash", "sh"):
            out += [line.split("  #")[0].strip() for line in body.splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    return out


def run_command(command: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """`command` as written, with `jaxdec` and `python` taken from this interpreter's
    environment (the venv that `make test` installed)."""
    argv = shlex.split(command)
    if argv[0] == "jaxdec":
        argv = [sys.executable, "-m", "jaxdec", *argv[1:]]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
        argv[1] = str(REPO / argv[1]) if argv[1].startswith("scripts/") else argv[1]
    bindir = str(pathlib.Path(sys.executable).parent)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env, timeout=3000)


def test_readme_is_a_short_users_page():
    lines = README.read_text().splitlines()
    assert len(lines) < 250, len(lines)
    for link in re.findall(r"\]\(([^)#]+)\)", README.read_text()):
        if not link.startswith("http"):
            assert (REPO / link).exists(), link


def test_every_readme_command_has_a_place_here():
    listed = [*QUICK, *SLOW, *NOT_RUN]
    assert len(set(listed)) == len(listed)
    commands = readme_commands()
    assert sorted(set(commands)) == sorted(listed), (
        "in the README, not here: " + repr(sorted(set(commands) - set(listed)))
        + "; here, not in the README: " + repr(sorted(set(listed) - set(commands))))


@pytest.mark.parametrize("command", QUICK)
def test_quick_readme_commands_run_as_written(command, tmp_path):
    r = run_command(command, tmp_path)
    assert r.returncode == 0, (command, r.stderr[-2000:])
    if command.startswith("jaxdec generate"):
        assert "tok/s" in r.stderr + r.stdout and len(r.stdout.strip()) > 20, r.stdout


def test_slow_readme_commands_run_as_written(tmp_path):
    for command in SLOW:
        r = run_command(command, tmp_path)
        assert r.returncode == 0, (command, r.stderr[-2000:])


def test_readme_python_example_runs_as_written(tmp_path):
    """The first Python block (load, generate, chat, score, save) as written, in a fresh
    directory (its checkpoint lands there)."""
    lang, body = next(b for b in _blocks(README.read_text()) if b[0] == "python")
    assert "jaxdec.load" in body and "jaxdec.save" in body
    r = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, capture_output=True,
                       text=True, timeout=3000)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout, r.stdout
    assert (tmp_path / "checkpoints" / "smollm2-orbax").is_dir()


@pytest.mark.slow
def test_readme_server_examples_work_as_written(tmp_path):
    """`jaxdec serve` as the README starts it (port 8000, as written), then its curl line and
    its `openai` block, each as written: the curl answer names Paris, the stream has text."""
    import json
    import socket

    from jaxdec.bench.serve_bench import serving

    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", 8000)) != 0, "port 8000 is taken: the README's server cannot start"
    argv = [sys.executable, "-m", "jaxdec", *shlex.split(SERVE)[1:]]
    with serving(argv, tmp_path / "server.log", timeout_s=900):  # (ready: GET /health answers)
        r = subprocess.run(shlex.split(CURL), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        answer = json.loads(r.stdout)
        assert "Paris" in answer["choices"][0]["text"], answer
        body = next(b for lang, b in _blocks(README.read_text()) if lang == "python" and "OpenAI(" in b)
        r = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert len(r.stdout.strip()) > 5, r.stdout


FOLDER = re.compile(r"`((?:jaxdec|pallas_kernels|scripts|tests|docs)(?:/[\w.]+)*/)`")


def test_architecture_page_names_every_folder_and_only_real_ones():
    named = set(FOLDER.findall(ARCHITECTURE.read_text()))
    missing = sorted(f for f in named if not (REPO / f).is_dir())
    assert not missing, f"named in docs/architecture.md, not in the tree: {missing}"
    folders = {f"{p.relative_to(REPO).as_posix()}/" for p in (REPO / "jaxdec").rglob("*")
               if p.is_dir() and p.name != "__pycache__" and not p.name.endswith(".egg-info")}
    unnamed = sorted(folders - named)
    assert not unnamed, f"folders of jaxdec/ that docs/architecture.md does not name: {unnamed}"


def test_the_architecture_check_has_teeth(tmp_path, monkeypatch):
    """A page that forgets a folder, or names one that is gone, fails the check."""
    text = ARCHITECTURE.read_text()
    page = tmp_path / "architecture.md"
    monkeypatch.setattr(sys.modules[__name__], "ARCHITECTURE", page)
    page.write_text(text.replace("`jaxdec/train/`", "the training folder"))
    with pytest.raises(AssertionError, match="jaxdec/train/"):
        test_architecture_page_names_every_folder_and_only_real_ones()
    page.write_text(text + "\n`jaxdec/engine_that_is_not_there/`\n")
    with pytest.raises(AssertionError, match="engine_that_is_not_there"):
        test_architecture_page_names_every_folder_and_only_real_ones()
