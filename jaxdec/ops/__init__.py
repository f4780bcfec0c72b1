"""Op dispatch below the model code: the quantised matmul (`qmatmul`) and the CPU kernels
(`cpu_kernel`: dense, quantised and expert matmuls and decode attention, in C++ under `csrc/`)."""
