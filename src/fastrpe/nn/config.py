"""Config dataclasses: JSON round trip, and refusal of unknown or invalid fields."""
from __future__ import annotations

import dataclasses
import json
from typing import Any


class ConfigMixin:
    """Mixin for model config dataclasses."""

    def __post_init__(self) -> None:  # checked when made, not at the first forward
        self.validate()

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(val, bool) or not isinstance(val, int)):
                raise ValueError(f"{type(self).__name__}: field {f.name!r} must be an int, got {val!r}")
            if f.type in ("int", int) and val < 0:
                raise ValueError(f"{type(self).__name__}: field {f.name!r} must be >= 0, got {val}")
            if f.type in ("float", float) and not isinstance(val, (int, float)):
                raise ValueError(f"{type(self).__name__}: field {f.name!r} must be a number, got {val!r}")
        for name in ("d_model", "n_heads", "vocab_size"):
            if hasattr(self, name) and getattr(self, name) <= 0:
                raise ValueError(f"{type(self).__name__}: field {name!r} must be positive")
        if hasattr(self, "d_model") and self.d_model % self.n_heads:
            raise ValueError(f"{type(self).__name__}: field 'd_model' ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if f.name.endswith("num_features") and val is not None and (
                    isinstance(val, bool) or not isinstance(val, int) or val <= 0):
                raise ValueError(f"{type(self).__name__}: field {f.name!r} must be a positive int or null, got {val!r}")
            if f.name.endswith("kernel") and val is not None and not isinstance(val, str):
                raise ValueError(f"{type(self).__name__}: field {f.name!r} must be a kernel name, got {val!r}")
        if hasattr(self, "dropout") and not 0 <= self.dropout < 1:
            raise ValueError(f"{type(self).__name__}: field 'dropout' must be in [0, 1), got {self.dropout}")
        from .._validate import FastRPEError, check_backend_name
        from ..kernels import get_kernel

        if hasattr(self, "backend"):
            check_backend_name(self.backend, f"{type(self).__name__}: field 'backend'")
        if isinstance(getattr(self, "kernel", None), str) and hasattr(self, "d_model"):
            try:
                get_kernel(self.kernel, head_dim=self.d_model // self.n_heads)
            except ValueError as e:
                raise FastRPEError(f"{type(self).__name__}: field 'kernel': {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field {unknown[0]!r} (known: {', '.join(sorted(names))})")
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, s: str):
        return cls.from_dict(json.loads(s))
