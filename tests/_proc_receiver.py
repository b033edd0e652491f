"""The receiver the cross-process sync test spawns (:class:`rollout_bridge.transports.ProcessReceiver` builds it in
the child): it copies what it receives into its own tensors, as vLLM's parameters are its own memory, and can hand
their bytes back."""

from __future__ import annotations

from rollout_bridge.transports import WeightReceiverMixin


class CopyAndDumpReceiver(WeightReceiverMixin):
    """Keeps a copy of every received tensor; :meth:`dump` returns ``{name: (dtype, shape, bytes)}``."""

    def __init__(self):
        self.params = {}

    def _fp8rl_load(self, named, kv_scales, version):
        for name, t in named:
            self.params[name] = t.clone()

    def dump(self):
        import torch

        return {k: (str(v.dtype), tuple(v.shape), v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                for k, v in self.params.items()}
