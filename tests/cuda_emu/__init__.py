"""A CPU emulator of mtpkern's CUDA kernels, for the tests (tests/test_cuda_emulated.py).

``emu_backend`` builds the real ``kernels/*.cu`` with g++ against ``include/emu_cuda.h``
(the emulated CUDA subset; its header says what is emulated and what only a GPU
checks), runs them with the fiber scheduler of ``emu_runtime.cpp``, and gives a
``CudaBackend`` on NumPy arrays. ``selftest.cu`` tests the emulator itself;
``run.sh`` runs the emulated tests with ASan or another thread order. See
docs/cuda.md, "Emulated kernels on the CPU".
"""
