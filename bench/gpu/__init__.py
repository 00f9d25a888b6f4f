"""What the GPU benches share (``harness``, ``workload``, ``env.sh``) and the phases of bench/sglang_gpu.py
that are questions of their own (``sglang_server``, ``trl_step``). How a GPU run is set up: bench/README.md."""
