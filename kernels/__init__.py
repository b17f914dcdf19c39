"""CUDA sources of mtpkern (one .cu per kernel family, plus common.cuh).

Shipped inside the wheel as package data of ``mtpkern.kernels``; located at
run time by ``mtpkern.backends.cuda_launch.loader.kernel_dir``.
"""
