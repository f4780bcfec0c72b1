"""HF reference computations in subprocesses, started when a test module is imported so
that HF's slow GGUF loading overlaps the rest of the suite."""

from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

from jaxdec.checkpoint import registry
from jaxdec.errors import JaxdecError

_ROOT = pathlib.Path(tempfile.mkdtemp(prefix="jaxdec_hf_jobs_"))
_JOBS: list["HfJob"] = []


class HfJob:
    """Runs `python -c script <gguf path> <out> *args` for a named real model; `wait()`
    returns `out`, fails the test if the model is not installed (`make models` fetches it) or
    the job failed."""

    def __init__(self, name: str, script: str, out_name: str, *args: str):
        self.name, self.out, self.proc, self.skip = name, _ROOT / out_name, None, None
        try:
            path = registry.resolve(name)
        except JaxdecError as e:
            self.skip = f"{e} (`make test` fetches the models the tests need)"
            return
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, str(path), str(self.out), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        _JOBS.append(self)

    def wait(self) -> pathlib.Path:
        if self.skip:
            pytest.fail(self.skip)
        _, err = self.proc.communicate()
        if self.proc.returncode:
            pytest.fail(f"HF reference job for {self.name} failed:\n{err[-3000:]}")
        return self.out


@atexit.register
def _cleanup():
    for job in _JOBS:
        if job.proc.poll() is None:
            job.proc.kill()
    shutil.rmtree(_ROOT, ignore_errors=True)
