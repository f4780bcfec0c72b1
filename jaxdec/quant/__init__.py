"""Quantization methods: weight transforms that turn a float model into a compressed one
(RTN, HQQ, GPTQ, AWQ, SmoothQuant, ZeroQuant, LLM.int8(), KurTail, llama.cpp's k-quants).
The formats they produce live in `jaxdec.formats`."""
