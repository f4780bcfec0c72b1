"""Write a GGUF file whose tensors are requantised to chosen llama.cpp block types.

    types = kquants.recipe_types(src, "Q4_K_M")
    write_gguf(src, "model.Q4_K_M.gguf", types, file_type="Q4_K_M")

Every tensor of the source GGUF is read (dequantised to float32 by `gguf.quants`),
quantised to its type in `types` by `kquants.quantize_blocks` and written in the source's
order and layout (llama.cpp's q/k row permutation included: the rows are the file's own).
A tensor whose target type is its source type, or that `types` does not name, is copied
byte for byte, as llama.cpp does. Every metadata key/value is copied with its own value
type (strings as their exact bytes), except general.file_type and
general.quantization_version, which are set; `gguf.GGUFWriter` writes the file.

Shapes are never adapted here: a row length that is not a multiple of the target type's
block is a one-line JaxdecError, raised before anything is written. llama.cpp's fallbacks
(Q4_K -> Q5_0, Q6_K -> Q8_0, ... -> F16) are applied by the recipes
(`kquants.fallback_type`), so recipe output always fits. The file is written to a
temporary file in the destination's directory and renamed over `out` only when complete.

The source header is parsed here (and by `read_gguf_header`), not by `gguf.GGUFReader`,
which builds a numpy view per vocabulary string (seconds per 100k tokens).
"""

from __future__ import annotations

import collections
import mmap
import os
import pathlib
import struct
import tempfile
from typing import Any, Callable, Mapping

import gguf
import numpy as np

from jaxdec.checkpoint.gguf_reader import read_gguf_header
from jaxdec.errors import JaxdecError
from jaxdec.quant import kquants

_Q = gguf.GGMLQuantizationType
_V = gguf.GGUFValueType
_SET_HERE = ("general.architecture", "general.file_type", "general.quantization_version")
GGML_QNT_VERSION = 2
_SCALAR = {_V.UINT8: "<B", _V.INT8: "<b", _V.UINT16: "<H", _V.INT16: "<h", _V.UINT32: "<I",
           _V.INT32: "<i", _V.FLOAT32: "<f", _V.BOOL: "<?", _V.UINT64: "<Q", _V.INT64: "<q",
           _V.FLOAT64: "<d"}
# llama.cpp's guess of a file's llama_ftype from its most common tensor type (llama-model-loader)
_GUESSED_FTYPE = {_Q.F32: 0, _Q.F16: 1, _Q.Q4_0: 2, _Q.Q4_1: 3, _Q.Q8_0: 7, _Q.Q5_0: 8, _Q.Q5_1: 9,
                  _Q.Q2_K: 10, _Q.Q3_K: 12, _Q.Q4_K: 15, _Q.Q5_K: 17, _Q.Q6_K: 18, _Q.BF16: 32}


def write_gguf(src: str | os.PathLike, out: str | os.PathLike, types: Mapping[str, str | _Q], *,
               file_type: int | str | None = None,
               progress: Callable[[int, int], None] | None = None) -> pathlib.Path:
    """Write `src` with each tensor quantised to types[name] (a GGML type name or enum) to
    `out`; returns out's path. file_type: general.file_type, as a llama_ftype number or a
    recipe name (`kquants.FILE_TYPES`); by default llama.cpp's own guess from the most
    common quantised type. progress(done, total) is called after each tensor is written."""
    header = read_gguf_header(src)
    out = pathlib.Path(out)
    if not out.parent.is_dir():
        raise JaxdecError(f"{out.parent}: no such directory")
    arch = header.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise JaxdecError(f"{header.path}: GGUF metadata has no general.architecture")
    plan = _plan(header, types)
    ftype = _file_type(file_type, plan)
    with open(header.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        metadata = _typed_metadata(buf)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    tmp = pathlib.Path(tmp_name)
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        _write(writer, header.path, metadata, plan, ftype, progress)
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


def _write(writer: gguf.GGUFWriter, src: pathlib.Path, metadata, plan, ftype: int, progress) -> None:
    for key, vtype, value, sub in metadata:
        if key in _SET_HERE or (vtype == _V.ARRAY and not len(value)):
            continue  # (GGUFWriter cannot pack an empty array)
        if key == "general.alignment":
            writer.data_alignment = int(value)
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.add_quantization_version(GGML_QNT_VERSION)
    writer.add_file_type(ftype)
    for info, q in plan:
        writer.add_tensor_info(info.name, info.shape, np.dtype(np.float32), _nbytes(info, q), raw_dtype=q)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for done, (info, q) in enumerate(plan):
        writer.write_tensor_data(_tensor_bytes(src, info, q))
        if progress is not None:
            progress(done + 1, len(plan))
    writer.close()


def _plan(header, types: Mapping[str, str | _Q]) -> list[tuple]:
    """[(tensor info, target type)] in file order; every problem is raised here, before a
    byte is written."""
    unknown = sorted(set(types) - set(header.tensors))
    if unknown:
        raise JaxdecError(f"types names {len(unknown)} tensor(s) the source does not have, "
                          f"e.g. {unknown[0]!r}")
    plan = []
    for info in header.tensors.values():
        q = kquants.qtype_of(types.get(info.name, info.qtype))
        if q != info.qtype:
            n_per_row = info.shape[-1]
            if q not in kquants.SUPPORTED:
                raise JaxdecError(f"{info.name}: cannot quantise to {q.name} (supported: "
                                  f"{', '.join(sorted(x.name for x in kquants.SUPPORTED))})")
            if n_per_row % kquants.block_size(q):
                raise JaxdecError(f"{info.name}: rows of {n_per_row} values do not fit {q.name} "
                                  f"blocks of {kquants.block_size(q)} (see kquants.fallback_type)")
            if info.nbytes is None:
                raise JaxdecError(f"{info.name}: cannot read its {info.type_name} blocks")
        plan.append((info, q))
    return plan


def _file_type(file_type: int | str | None, plan) -> int:
    if isinstance(file_type, str):
        if file_type not in kquants.FILE_TYPES:
            raise JaxdecError(f"unknown recipe {file_type!r} for file_type "
                              f"(one of {', '.join(kquants.FILE_TYPES)})")
        return kquants.FILE_TYPES[file_type]
    if file_type is not None:
        return int(file_type)
    counts = collections.Counter(q for _, q in plan if q != _Q.F32)
    top = counts.most_common(1)[0][0] if counts else _Q.F32
    return _GUESSED_FTYPE.get(top, 0)


# ---- the source's metadata, with its value types ---------------------------------------------

def _typed_metadata(buf) -> list[tuple[str, Any, Any, Any]]:
    """[(key, GGUFValueType, value, array element type or None)] of a GGUF file whose header
    `read_gguf_header` has validated. Values are as GGUFWriter packs them: strings as bytes,
    arrays as lists."""
    (n_kv,) = struct.unpack_from("<Q", buf, 16)
    pos, out = 24, []
    for _ in range(n_kv):
        key, pos = _string(buf, pos)
        vtype = _V(struct.unpack_from("<I", buf, pos)[0])
        value, sub, pos = _value(buf, pos + 4, vtype)
        out.append((key.decode("utf-8"), vtype, value, sub))
    return out


def _string(buf, pos: int) -> tuple[bytes, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8:pos + 8 + n]), pos + 8 + n


def _value(buf, pos: int, vtype) -> tuple[Any, Any, int]:
    if vtype == _V.STRING:
        value, pos = _string(buf, pos)
        return value, None, pos
    if vtype in _SCALAR:
        return struct.unpack_from(_SCALAR[vtype], buf, pos)[0], None, pos + struct.calcsize(_SCALAR[vtype])
    sub = _V(struct.unpack_from("<I", buf, pos)[0])
    (n,) = struct.unpack_from("<Q", buf, pos + 4)
    pos += 12
    if sub in _SCALAR:
        dtype = np.dtype(_SCALAR[sub])
        return np.frombuffer(buf, dtype, count=n, offset=pos).tolist(), sub, pos + n * dtype.itemsize
    if sub != _V.STRING:
        raise JaxdecError("GGUF metadata holds an array of arrays, which the writer does not copy")
    items = []
    for _ in range(n):
        item, pos = _string(buf, pos)
        items.append(item)
    return items, sub, pos


# ---- tensors ----------------------------------------------------------------------------------

def _nbytes(info, q: _Q) -> int:
    block, size = gguf.GGML_QUANT_SIZES[q]
    return int(np.prod(info.shape, dtype=np.int64)) // block * size


def _tensor_bytes(src: pathlib.Path, info, q: _Q) -> np.ndarray:
    """u8 bytes of one tensor in type q: the source's own when q is its type."""
    raw = np.fromfile(src, np.uint8, count=info.nbytes, offset=info.start)
    if q == info.qtype:
        return raw
    rows, n_per_row = int(np.prod(info.shape[:-1], dtype=np.int64)), info.shape[-1]
    try:
        w = gguf.quants.dequantize(raw.reshape(rows, -1), info.qtype)
    except NotImplementedError:
        raise JaxdecError(f"{info.name}: gguf cannot dequantise {info.type_name}") from None
    return kquants.quantize_blocks(np.asarray(w, np.float32).reshape(rows, n_per_row), q)
