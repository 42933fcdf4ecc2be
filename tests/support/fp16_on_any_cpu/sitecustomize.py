"""Put on PYTHONPATH of a training run so that DeepSpeed admits fp16 on any CPU (tests/processes/test_fp16_resume.py).

DeepSpeed's CPU accelerator admits fp16 only where oneDNN has fp16 kernels, which some x86 CPUs lack; torch
computes fp16 on every CPU all the same. The tests of the fp16 loss scale need a real DeepSpeed fp16 engine on
whatever machine runs them, so this lifts that one check, when DeepSpeed's CPU accelerator module is first imported
(importing DeepSpeed here would slow every process that starts, torchrun included). Nothing else is changed.
"""

import importlib.abc
import importlib.machinery
import sys

CPU_ACCELERATOR = "deepspeed.accelerator.cpu_accelerator"


class AdmitFp16(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != CPU_ACCELERATOR:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            module.CPU_Accelerator.is_fp16_supported = lambda self: True

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, AdmitFp16())
