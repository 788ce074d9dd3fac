"""Makes vLLM's CPU build choose the kernels of an x86 CPU without AVX-512 / AMX (its ``_C_AVX2`` library, the
``vec`` attention), for running the vLLM tests as another CPU would (docs/developer.md, "Tests that sample").

vLLM asks ``torch.cpu._is_avx512_supported()`` and friends, which read the processor's flags and ignore
``ATEN_CPU_CAPABILITY``; this file answers them with False in every Python process started while its folder is on
``PYTHONPATH`` (Python imports a ``sitecustomize`` module at start-up; child processes inherit the path). Together
with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`` for torch, oneDNN and MKL.
"""

try:
    import torch.cpu
except ImportError:  # an interpreter without torch (a venv being built): nothing to answer
    pass
else:
    for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                  "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, _name):
            setattr(torch.cpu, _name, lambda: False)
