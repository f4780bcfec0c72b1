"""Read a llama.cpp GGUF file into a `Checkpoint` (HF names, HF shapes, float32).

The header (metadata and tensor table) is parsed here with `struct` over a read-only
mmap: `gguf.GGUFReader` builds a numpy view per vocabulary string, which costs seconds
per 100k tokens. Tensor bytes are dequantized with `gguf.quants.dequantize`, one
tensor at a time, so peak memory is the float32 result plus one tensor.

GGUF stores dims innermost-first (`[in, out]`); the numpy shape is the reverse, which is
already HF's `[out, in]`. llama.cpp's converter permutes the rows of `attn_q`/`attn_k`
for the 'llama' architecture (each head's two rotary halves interleaved, for its
GPT-J-style RoPE); `_unpermute_rows` undoes it. 'qwen2' and 'gemma3' use NEOX RoPE and are
stored as is. llama.cpp stores Gemma's norm weights as the scale 1 + w itself; they are read
back as HF's w.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import pathlib
import re
import struct
from typing import Any

import gguf
import numpy as np

from jaxdec.checkpoint.common import Checkpoint, LazyTensors, missing_tensors_error, validate
from jaxdec.checkpoint.hf_layout import hf_tensor_shapes
from jaxdec.checkpoint.tokenizer import Tokenizer
from jaxdec.config import ModelConfig, RopeScaling
from jaxdec.errors import JaxdecError
from jaxdec.formats.gguf_blocks import gguf_block_bits, qarray_from_gguf

SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")
_Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = frozenset({_Q.F32, _Q.F16, _Q.BF16, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0,
                             _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K})

# Scalar metadata value types: GGUFValueType -> struct format.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9

# GGUF tensor name (with {i} for the block) -> HF name.
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
# Per architecture, where it differs: Gemma's norm before the MLP (its post_attention_layernorm
# norms the attention's output).
_ARCH_GGUF_TO_HF = {
    "gemma3": {"blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight"},
}
_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class GgufTensorInfo:
    """One entry of the tensor table. `shape` is numpy order (GGUF dims reversed);
    `start` is the absolute file offset of its bytes; `qtype` is an int when ggml's enum
    does not know it."""

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType | int
    start: int
    nbytes: int | None

    @property
    def type_name(self) -> str:
        return self.qtype.name if isinstance(self.qtype, _Q) else f"type {self.qtype}"


@dataclasses.dataclass(frozen=True)
class GgufHeader:
    """A GGUF file's metadata (plain Python values; arrays as lists or numpy arrays) and
    tensor table. Invariant: every tensor with a known type lies inside the file."""

    path: pathlib.Path
    metadata: dict[str, Any]
    tensors: dict[str, GgufTensorInfo]


class _Cursor:
    """Little-endian reads from a buffer; any read past its end is a truncated file."""

    def __init__(self, buf, pos: int = 0):
        self.buf, self.pos = buf, pos

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string runs past the end of the file")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        etype, n = self.scalar("<I"), self.scalar("<Q")
        if etype in _NUMPY:
            arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=n, offset=self.pos).copy()
            self.pos += arr.nbytes
            return arr
        if n > len(self.buf) - self.pos:
            raise struct.error("array runs past the end of the file")
        return [self.value(etype) for _ in range(n)]


def _parse_header(buf, path: pathlib.Path) -> GgufHeader:
    cur = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise JaxdecError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise JaxdecError(f"{path}: unsupported GGUF version {version} (big-endian or too old?)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    if n_tensors > len(buf) or n_kv > len(buf):
        raise JaxdecError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    table = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.scalar("<I")
        dims = [cur.scalar("<Q") for _ in range(n_dims)]
        table.append((name, tuple(reversed(dims)), cur.scalar("<I"), cur.scalar("<Q")))
    align = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // align) * align
    tensors = {name: _tensor_info(name, shape, qtype, data_start + offset)
               for name, shape, qtype, offset in table}
    for t in tensors.values():
        if t.nbytes is not None and t.start + t.nbytes > len(buf):
            raise JaxdecError(f"{path}: truncated GGUF file: tensor {t.name!r} ends at byte "
                              f"{t.start + t.nbytes:,} but the file has {len(buf):,} bytes")
    return GgufHeader(path=path, metadata=metadata, tensors=tensors)


def _tensor_info(name: str, shape: tuple[int, ...], qtype: int, start: int) -> GgufTensorInfo:
    try:
        qtype = _Q(qtype)
    except ValueError:
        return GgufTensorInfo(name, shape, qtype, start, None)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape, dtype=np.int64))
    return GgufTensorInfo(name, shape, qtype, start, n // block * size)


def read_gguf_header(path: str | pathlib.Path) -> GgufHeader:
    """Parse a GGUF file's metadata and tensor table; a one-line JaxdecError if it is not
    a readable GGUF file (missing, truncated, corrupt)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise JaxdecError(f"{path}: no such file")
    with open(path, "rb") as f, _mapped(f, path) as buf:
        try:
            return _parse_header(buf, path)
        except (struct.error, ValueError, UnicodeDecodeError, OverflowError, MemoryError) as e:
            raise JaxdecError(f"{path}: truncated or corrupt GGUF file ({e})") from None


def _mapped(f, path: pathlib.Path) -> mmap.mmap:
    try:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError:  # an empty file cannot be mapped
        raise JaxdecError(f"{path}: not a GGUF file (empty)") from None


# ---- metadata -> ModelConfig -----------------------------------------------------------------
def _key(meta: dict[str, Any], key: str, default: Any = ...) -> Any:
    if key in meta:
        value = meta[key]
        if isinstance(value, (np.ndarray, list)):
            raise JaxdecError(f"GGUF metadata {key!r} is an array; per-layer values are unsupported")
        return value
    if default is ...:
        raise JaxdecError(f"GGUF metadata key {key!r} is missing")
    return default


def _rope_scaling(meta: dict[str, Any], arch: str, rope_freqs: np.ndarray | None,
                  head_dim: int, theta: float) -> RopeScaling | None:
    """RoPE scaling from `{arch}.rope.scaling.*`, or Llama 3's baked `rope_freqs.weight`."""
    kind = str(_key(meta, f"{arch}.rope.scaling.type", "none"))
    factor = float(_key(meta, f"{arch}.rope.scaling.factor", 1.0))
    original = int(_key(meta, f"{arch}.rope.scaling.original_context_length", 8192))
    if kind == "linear" and factor != 1.0:
        return RopeScaling(kind="linear", factor=factor, original_max_position=original)
    if kind == "llama3":
        return RopeScaling(kind="llama3", factor=factor, original_max_position=original,
                           low_freq_factor=float(_key(meta, f"{arch}.rope.scaling.low_freq_factor", 1.0)),
                           high_freq_factor=float(_key(meta, f"{arch}.rope.scaling.high_freq_factor", 4.0)))
    if kind not in ("none", "linear"):
        raise JaxdecError(f"unsupported RoPE scaling type {kind!r} in GGUF metadata")
    if rope_freqs is None:
        return None
    return _llama3_from_rope_freqs(rope_freqs, head_dim, theta)


def _llama3_from_rope_freqs(factors: np.ndarray, head_dim: int, theta: float) -> RopeScaling:
    """llama.cpp bakes Llama 3 scaling into per-frequency divisors (`rope_freqs.weight`).

    Assumes Llama 3.1/3.2's band (low 1, high 4, original 8192), takes `factor` as the
    largest divisor, and checks that this reproduces every divisor.
    """
    scaling = RopeScaling(kind="llama3", factor=float(np.max(factors)))
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    expected = np.where(smooth >= 1, 1.0, np.where(
        smooth <= 0, scaling.factor, 1 / ((1 - smooth) / scaling.factor + smooth)))
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-3):
        raise JaxdecError("rope_freqs.weight does not match Llama 3 RoPE scaling "
                          "(low 1, high 4, original 8192); unsupported")
    return scaling


def _gemma3(meta: dict[str, Any], d: int, n: int, n_layers: int) -> dict[str, Any]:
    """Gemma 3's fields beyond the Llama family's, with llama.cpp's fixed choices: every sixth
    layer global, the others windowed with RoPE base 10000 unless `rope.freq_base_swa` says;
    scores scaled by (D/N)^-1/2 on the 27B (62 layers), by H^-1/2 on the others."""
    for key in ("gemma3.final_logit_softcapping", "gemma3.attn_logit_softcapping"):
        if key in meta:
            raise JaxdecError(f"GGUF metadata {key!r}: logit soft-capping is unsupported")
    window = int(_key(meta, "gemma3.attention.sliding_window"))
    return dict(mlp_act="gelu_tanh", embed_scale=math.sqrt(d), post_norms=True,
                query_scale=(d / n) ** -0.5 if n_layers == 62 else None,
                layer_windows=tuple(None if (i + 1) % 6 == 0 else window for i in range(n_layers)),
                rope_local_theta=float(_key(meta, "gemma3.rope.freq_base_swa", 10000.0)))


def _config(meta: dict[str, Any], header: GgufHeader, tok: Tokenizer,
            rope_freqs: np.ndarray | None) -> ModelConfig:
    arch = meta["general.architecture"]
    d, n = int(_key(meta, f"{arch}.embedding_length")), int(_key(meta, f"{arch}.attention.head_count"))
    head_dim = int(_key(meta, f"{arch}.attention.key_length",
                        _key(meta, f"{arch}.rope.dimension_count", d // n)))
    theta = float(_key(meta, f"{arch}.rope.freq_base", 10000.0))
    embed = header.tensors.get("token_embd.weight")
    n_layers = int(_key(meta, f"{arch}.block_count"))
    return ModelConfig(
        arch=arch,
        vocab_size=embed.shape[0] if embed is not None else tok.vocab_size,
        d_model=d, n_layers=n_layers, n_heads=n,
        n_kv_heads=int(_key(meta, f"{arch}.attention.head_count_kv", n)), head_dim=head_dim,
        d_ff=int(_key(meta, f"{arch}.feed_forward_length")),
        norm_eps=float(_key(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(meta, arch, rope_freqs, head_dim, theta),
        tie_embeddings="output.weight" not in header.tensors,
        qkv_bias="blk.0.attn_q.bias" in header.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in header.tensors,
        max_position=int(_key(meta, f"{arch}.context_length", 4096)),
        eos_ids=tok.stop_ids, bos_id=tok.bos_id,
        **(_gemma3(meta, d, n, n_layers) if arch == "gemma3" else {}))


# ---- tensors -------------------------------------------------------------------------------
def _hf_name(gguf_name: str, arch: str) -> str | None:
    m = _BLOCK.match(gguf_name)
    pattern = _BLOCK.sub("blk.{i}.", gguf_name) if m else gguf_name
    hf = _ARCH_GGUF_TO_HF.get(arch, {}).get(pattern, _GGUF_TO_HF.get(pattern))
    return hf.format(i=m.group(1)) if hf and m else hf


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows stored as (H/2, 2) pairs go back
    to HF's (2, H/2) halves. Works for weights [N*H, D] and biases [N*H]."""
    rest = w.shape[1:]
    return w.reshape(n_heads, -1, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _dequantize(buf, info: GgufTensorInfo) -> np.ndarray:
    raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.start)
    rows = int(np.prod(info.shape[:-1], dtype=np.int64))
    out = gguf.quants.dequantize(raw.reshape(rows, -1), info.qtype)
    out = out.reshape(info.shape)
    return out.copy() if info.qtype == _Q.F32 else out.astype(np.float32, copy=False)


def _check_tensors(header: GgufHeader, cfg: ModelConfig) -> dict[str, str]:
    """GGUF name -> HF name for every tensor the model uses, after checking (before any
    dequantization) that none is unknown, missing, of an unsupported type or misshapen."""
    names = {}
    for name in header.tensors:
        if name == "rope_freqs.weight":
            continue
        hf = _hf_name(name, cfg.arch)
        if hf is None:
            raise JaxdecError(f"{header.path}: unsupported tensor {name!r} for architecture {cfg.arch!r}")
        names[name] = hf
    shapes = hf_tensor_shapes(cfg)
    missing = [hf for hf in shapes if hf not in names.values()]
    if missing:
        raise missing_tensors_error(str(header.path), missing)
    for name, hf in names.items():
        info = header.tensors[name]
        if info.qtype not in SUPPORTED_TYPES:
            raise JaxdecError(f"{header.path}: tensor {name!r} has unsupported type {info.type_name}")
        if hf not in shapes or info.shape != shapes[hf]:
            raise JaxdecError(f"{header.path}: tensor {name!r} has shape {info.shape}, "
                              f"expected {shapes.get(hf)} from the metadata")
    return names


def read_gguf(path: str | pathlib.Path, *, progress=None, keep_blocks: bool = False) -> Checkpoint:
    """A GGUF file (architectures 'llama', 'qwen2', 'gemma3') as a `Checkpoint` of float32 HF
    tensors.

    `progress(done, total)`, if given, is called after each tensor is dequantized. With
    `keep_blocks`, linear weights stored as Q8_0 / Q4_0 / Q4_1 also come back as exact
    `QArray`s in `Checkpoint.blocks`.

    Every user-facing problem (missing/truncated/corrupt file, unsupported architecture,
    tokenizer or tensor type, missing tensors) is a one-line JaxdecError.
    """
    header = read_gguf_header(path)
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise JaxdecError(f"{header.path}: unsupported architecture {arch!r} "
                          f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    tok = Tokenizer.from_gguf(meta)
    with open(header.path, "rb") as f, _mapped(f, header.path) as buf:
        freqs = header.tensors.get("rope_freqs.weight")
        rope_freqs = _dequantize(buf, freqs) if freqs and freqs.qtype in SUPPORTED_TYPES else None
        try:
            cfg = _config(meta, header, tok, rope_freqs)
        except ValueError as e:
            raise JaxdecError(f"{header.path}: invalid model metadata ({e})") from None
        names = _check_tensors(header, cfg)
        blocks = {}
        for name, hf in names.items() if keep_blocks else ():
            if len(header.tensors[name].shape) == 2:
                qa = _load_blocks(buf, header.tensors[name], hf, cfg)
                if qa is not None:
                    blocks[hf] = qa
    by_hf = {hf: name for name, hf in names.items()}
    done = []

    def read(hf: str) -> np.ndarray:  # one tensor, dequantized when it is looked up
        with open(header.path, "rb") as f, _mapped(f, header.path) as buf:
            w = _load_tensor(buf, header.tensors[by_hf[hf]], hf, cfg)
        done.append(hf)
        if progress is not None:
            progress(min(len(done), len(names)), len(names))
        return w

    shapes = hf_tensor_shapes(cfg)
    tensors = LazyTensors({hf: shapes[hf] for hf in by_hf}, read)
    types = {hf: header.tensors[name].type_name for name, hf in names.items()}
    return validate(Checkpoint(config=cfg, tensors=tensors, tokenizer=tok, tensor_types=types,
                               blocks=blocks), str(header.path))


def _load_tensor(buf, info: GgufTensorInfo, hf: str, cfg: ModelConfig) -> np.ndarray:
    w = _dequantize(buf, info)
    if cfg.arch == "gemma3" and hf.endswith("norm.weight"):  # stored as 1 + w (module docstring)
        w = w - np.float32(1)
    heads = _permuted_heads(hf, cfg)
    return w if heads is None else _unpermute_rows(w, heads)


def _permuted_heads(hf: str, cfg: ModelConfig) -> int | None:
    """llama.cpp permutes the rows of llama q/k projections; the head count to undo it."""
    if cfg.arch == "llama" and ".self_attn.q_proj." in hf:
        return cfg.n_heads
    if cfg.arch == "llama" and ".self_attn.k_proj." in hf:
        return cfg.n_kv_heads
    return None


def _load_blocks(buf, info: GgufTensorInfo, hf: str, cfg: ModelConfig):
    """The tensor's own blocks as a QArray of the [in, out] matrix, or None if its type
    does not map (rows un-permuted like `_load_tensor`: a permutation of QArray columns)."""
    if gguf_block_bits(info.qtype) is None:
        return None
    out_dim, in_dim = info.shape
    raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.start)
    qa = qarray_from_gguf(raw.reshape(out_dim, -1), info.qtype, out_dim, in_dim)
    heads = _permuted_heads(hf, cfg)
    if qa is None or heads is None:
        return qa
    cols = _unpermute_rows(np.arange(out_dim), heads)
    take = lambda a: None if a is None else np.ascontiguousarray(a[:, cols])
    return dataclasses.replace(qa, q=take(qa.q), scale=take(qa.scale), offset=take(qa.offset))
