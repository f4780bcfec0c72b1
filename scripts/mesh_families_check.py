"""Every tiny HF family of the architectures issue (built offline by tests/tiny_families.py,
which needs torch and transformers) on the four layouts of the mesh issue: True where the
greedy tokens equal the single-device run's.

    .venv/bin/python scripts/mesh_families_check.py
"""
import os, sys, pathlib, tempfile
os.environ["XLA_FLAGS"]="--xla_force_host_platform_device_count=8"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import numpy as np, jaxdec
from jaxdec import api, sharding
import tiny_families as tf
rows = [[5, 17, 3, 99, 42], [7, 7, 1, 64, 23, 88, 2, 91, 30, 11, 6], [120, 0, 57]]
for name in ["deepseek_v3","qwen2_moe","qwen3_moe","mixtral","mamba2","nemotron_h"]:
    d = pathlib.Path(tempfile.mkdtemp())/name
    tf.save(name, d)
    ref = api.generate_ids(jaxdec.load(d), rows, max_new_tokens=12).token_ids
    res = []
    for spec in ["model=4","data=2,model=4","expert=4","data=8"]:
        try:
            res.append((spec, api.generate_ids(jaxdec.load(d, mesh=spec), rows, max_new_tokens=12).token_ids == ref))
        except jaxdec.JaxdecError as e:
            res.append((spec, f"refused: {e}"))
    print(name, res, flush=True)
