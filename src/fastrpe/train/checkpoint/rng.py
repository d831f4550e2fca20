"""The random state of one process, captured into and restored from a checkpoint."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class RngState:
    """The random state of one process: torch CPU (and CUDA), python `random`, numpy."""

    torch_cpu: Tensor
    cuda: list[Tensor] = field(default_factory=list)
    python: Any = None
    numpy: Any = None

    @classmethod
    def capture(cls) -> RngState:
        cuda = []
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
        v, internal, gauss = random.getstate()
        py = [v, list(internal), gauss]
        np_state = None
        try:
            import numpy as np
        except ImportError:
            np = None
        if np is not None:
            name, keys, pos, has_gauss, cached = np.random.get_state()
            np_state = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
        return cls(torch.get_rng_state(), cuda, py, np_state)

    def restore(self) -> None:
        torch.set_rng_state(self.torch_cpu)
        if self.cuda and torch.cuda.is_available():
            for i, s in enumerate(self.cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)
        if self.python is not None:
            v, internal, gauss = self.python
            random.setstate((v, tuple(internal), gauss))
        if self.numpy is not None:
            try:
                import numpy as np
            except ImportError:
                return
            name, keys, pos, has_gauss, cached = self.numpy
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))

    def problem(self) -> str | None:
        """Why this state cannot be restored here (a malformed saved state), or None."""
        ref = torch.get_rng_state()
        if self.torch_cpu.dtype != torch.uint8 or self.torch_cpu.shape != ref.shape:
            return (f"torch RNG state has dtype {self.torch_cpu.dtype} and shape {tuple(self.torch_cpu.shape)}, "
                    f"expected uint8 {tuple(ref.shape)}")
        if self.python is not None:
            ok = (isinstance(self.python, list) and len(self.python) == 3 and isinstance(self.python[1], list)
                  and all(isinstance(x, int) for x in self.python[1]))
            if not ok:
                return "python RNG state is malformed"
        if self.numpy is not None:
            ok = (isinstance(self.numpy, list) and len(self.numpy) == 5 and isinstance(self.numpy[1], list)
                  and len(self.numpy[1]) == 624)
            if not ok:
                return "numpy RNG state is malformed"
        return None
