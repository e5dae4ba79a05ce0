"""How a "pure" low-precision run writes its optimizer's update into its weights
(``precision.update``): rounded to nearest (torch's own step: the default, unchanged), rounded
stochastically, or Kahan-compensated. What each rule is for, and what it costs in memory:
docs/precisions.md, *Pure precisions*.

:class:`WeightUpdate` hooks the optimizer's ``step`` (torch's step pre- and post-hooks; the loop,
the scheduler and ``state_dict`` see the optimizer they built):

- before the step, the optimizer's groups hold, in place of each parameter that has a gradient, a
  temporary FP32 copy with an FP32 gradient and its optimizer state (moments, momentum; not
  torch's FP32 ``step`` counts) in FP32, so torch's own optimizer math (SGD, AdamW, fused or not)
  runs in FP32, as torchao's BF16 AdamW does; the parameter itself is left alone (its storage, its
  gradient and the autograd hooks DDP reduces gradients through);
- after the step, the parameter is back in its group, its state tensors stored in its dtype again,
  rounded to nearest (pure training keeps its state in low precision, as with ``nearest``), and
  its weight written into its own storage: ``stochastic``: rounded stochastically to BF16
  (:func:`mptrain.precision.rounding.stochastic_round`); ``kahan``: the FP32 result plus a
  per-parameter compensation buffer (the weight's dtype, as in Zamirai et al. 2020, "Revisiting
  BFloat16 Training") rounded to nearest, the rounding error kept in the buffer for the next
  step: the weight plus its buffer carries every update.

Determinism and resume: the random bits come from one ``torch.Generator`` on the parameters'
device, drawn per parameter in the optimizer's order; :meth:`WeightUpdate.state_dict` holds its
state and the Kahan buffers, so a resumed run rounds as an uninterrupted one, and under DDP every
rank's weights stay equal.
"""

from __future__ import annotations

from typing import Any

import torch

from mptrain.platform.seeding import ROUNDING_STREAM, stream_seed
from mptrain.precision.rounding import stochastic_round


def _follows_dtype(key: str, value: Any) -> bool:
    """Whether an entry of a parameter's optimizer state follows its dtype (moments, momentum):
    every floating-point tensor but the step count (torch keeps it in FP32 whatever the
    parameters' dtype: left alone)."""
    return key != "step" and torch.is_tensor(value) and value.is_floating_point()


class WeightUpdate:
    """Writes the optimizer's FP32 update into low-precision weights by ``rule`` (module doc).

    ``rule``: ``stochastic`` (BF16 parameters only) or ``kahan``; ``nearest`` needs no hooks (use
    :func:`build_weight_update`, which returns None for it). ``seed``: the generator's seed.
    Raises ValueError for another rule or, with ``stochastic``, non-BF16 parameters.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, rule: str, seed: int, device: torch.device
    ) -> None:
        if rule not in ("stochastic", "kahan"):
            raise ValueError(f"WeightUpdate: rule must be stochastic or kahan, got {rule!r}")
        self.optimizer, self.rule = optimizer, rule
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        if rule == "stochastic" and any(p.dtype != torch.bfloat16 for p in self.params):
            raise ValueError("WeightUpdate: stochastic rounding needs BF16 parameters")
        self.generator = (
            torch.Generator(device=device).manual_seed(seed) if rule == "stochastic" else None
        )
        self.compensation = [torch.zeros_like(p) for p in self.params] if rule == "kahan" else []
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._widened: list[tuple[list[torch.Tensor], int, torch.Tensor]] = []
        self._keeping = False  # keep_results(): the FP32 results of a step the probe measures
        self._results: dict[int, torch.Tensor] = {}
        self._handles = [
            optimizer.register_step_pre_hook(self._widen),
            optimizer.register_step_post_hook(self._write_back),
        ]

    def _widen(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """Before the step: each parameter that has a gradient stands in as an FP32 copy (module
        doc). Changing the parameter's dtype in place instead would reset its autograd gradient
        accumulator, where DDP's all-reduce hooks hang."""
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                if p.grad is None:
                    continue
                wide = torch.nn.Parameter(p.detach().float())
                wide.grad = p.grad.float()
                state = optimizer.state.pop(p, None)
                if state is not None:
                    optimizer.state[wide] = {
                        k: v.float() if _follows_dtype(k, v) else v for k, v in state.items()
                    }
                params[i] = wide
                self._widened.append((params, i, p))

    @torch.no_grad()
    def _write_back(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """After the step: each weight by the rule into its own storage, its state rounded to
        nearest, the parameter back in its group."""
        widened, self._widened = self._widened, []
        for params, i, p in widened:
            wide, params[i] = params[i], p
            result = wide.detach()
            if self.generator is not None:
                p.copy_(stochastic_round(result, generator=self.generator))
                if self._keeping:
                    self._results[id(p)] = result
            else:
                buffer = self.compensation[self._index[id(p)]]
                target = result + buffer.float()  # the weight plus what earlier roundings left
                p.copy_(target)
                buffer.copy_(target - p.float())
            state = optimizer.state.pop(wide, None)
            if state is not None:  # moments created in FP32 by a first step are stored low too
                optimizer.state[p] = {
                    k: v.to(p.dtype) if _follows_dtype(k, v) else v for k, v in state.items()
                }

    def keep_results(self, on: bool) -> None:
        """For the loop's probe around a step it measures: keep that step's FP32 results for
        :meth:`landing` (on), or drop them (off). Either way nothing kept so far is."""
        self._keeping, self._results = on, {}

    def landing(self, p: torch.Tensor) -> torch.Tensor:
        """FP32: where ``p``'s updates are kept, for the loop's lost-update probe. ``kahan``: the
        weight plus its buffer. ``stochastic``: the weight, or, after a step taken while keeping
        results, the FP32 result that was rounded: the weight's expected value, so an update
        counts as lost only where that equals the old weight (no chance to move it), not wherever
        this step's draw happened to leave the weight where it was."""
        if self.rule == "kahan":
            return p.detach().float() + self.compensation[self._index[id(p)]].float()
        result = self._results.get(id(p))
        return p.detach().float() if result is None else result

    def state_dict(self) -> dict[str, Any]:
        """The rule, the generator's state (``stochastic``) and the buffers (``kahan``, in the
        optimizer's parameter order): tensors and plain types, for a checkpoint."""
        return {
            "rule": self.rule,
            "generator": None if self.generator is None else self.generator.get_state(),
            "compensation": [c.detach().clone() for c in self.compensation],
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned. Raises ValueError for another rule or
        another number of parameters (the caller decides what a mismatch means)."""
        if saved.get("rule") != self.rule:
            raise ValueError(
                f"update state of rule {saved.get('rule')!r}, this run's is {self.rule!r}"
            )
        if self.generator is not None:
            self.generator.set_state(saved["generator"])
        if len(saved["compensation"]) != len(self.compensation):
            raise ValueError(
                f"{len(saved['compensation'])} Kahan buffers saved, {len(self.compensation)} parameters now"
            )
        for buffer, value in zip(self.compensation, saved["compensation"], strict=True):
            buffer.copy_(value)

    def remove(self) -> None:
        """Unhook the optimizer: its steps round to nearest again."""
        for handle in self._handles:
            handle.remove()


def build_weight_update(
    optimizer: torch.optim.Optimizer, rule: str, run_seed: int, device: torch.device
) -> WeightUpdate | None:
    """The hooks for ``precision.update=rule`` on ``optimizer``, their random bits seeded from
    the run's ``seed`` (a stream of their own: not the weights' or the data's draws); None for
    ``nearest`` (torch's own step, bit for bit what pure precisions always ran)."""
    if rule == "nearest":
        return None
    return WeightUpdate(optimizer, rule, stream_seed(run_seed, 0, ROUNDING_STREAM), device)
