"""jaxdec: a JAX/XLA decoding stack for large language models, written as pure functions."""

from jaxdec.api import GenerateResult, Model, generate, load, save, score
from jaxdec.config import ModelConfig, RopeScaling
from jaxdec.errors import JaxdecError
from jaxdec.sampling import Greedy, MinP, Sample, Temperature, TopK, TopP

__all__ = [
    "GenerateResult", "Greedy", "JaxdecError", "MinP", "Model", "ModelConfig", "RopeScaling",
    "Sample", "Temperature", "TopK", "TopP", "generate", "load", "save", "score",
]
