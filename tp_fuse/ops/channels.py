"""Named extra-tensor channels: extra outputs wired to later ops' extra inputs.

By default an op's extra input (``AddExtraInput``'s residual) is passed in by the
caller and an extra output (``MakeExtraOutput``'s) is returned to the caller. A
*channel* keeps such a tensor inside the fuser instead (Transformer Engine's API)::

    residual = MakeExtraOutput().set_extra_output_channel(0, "residual")
    add = AddExtraInput().set_extra_input_channel(0, "residual")
    y, r = Sequential(residual, body, add)(x)     # y = body(x) + x; r = x

Rules (checked when a fuser is built, with Transformer Engine's error messages):

* a channel name has at most one producer (one extra-output slot in the fuser);
* a consumer (extra-input slot bound to a name) needs a producer EARLIER in the same
  fuser: channels only connect forward, and never cross a non-fusible module;
* one producer may feed several consumers; its gradient is the sum of theirs (plus
  the caller's, when the output is also returned: ``output_to_caller=True``, the default);
* bindings are frozen once a fuser has captured them (building a fuser, a
  ``Sequential`` group, or calling the op directly).

:class:`ExtraTensorChannels` is the per-op part (a mixin of ``BasicOperation``);
:class:`ChannelRouting` is what a fuser derives from its ops' bindings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

__all__ = ["ChannelRouting", "ExtraTensorChannels"]

Slot = tuple[int, int]  # (basic op index in the fuser, extra input/output index)


class ExtraTensorChannels:
    """Channel bindings of one basic op's extra-input and extra-output slots.

    State is created on first use (sized by ``num_extra_inputs``/``num_extra_outputs``)
    so that ops need not call a particular ``__init__``.
    """

    num_extra_inputs: int = 0
    num_extra_outputs: int = 0

    def _channel_state(self) -> dict[str, Any]:
        state = self.__dict__.get("_extra_channel_state")
        if state is None:
            state = {
                "inputs": [None] * self.num_extra_inputs,
                "outputs": [None] * self.num_extra_outputs,
                "to_caller": [True] * self.num_extra_outputs,
                "locked": False,
            }
            self.__dict__["_extra_channel_state"] = state
        return state

    @property
    def _extra_input_channels(self) -> list[Optional[str]]:
        """Channel name per extra-input slot (None: passed in by the caller)."""
        return self._channel_state()["inputs"]

    @property
    def _extra_output_channels(self) -> list[Optional[str]]:
        """Channel name per extra-output slot (None: only returned to the caller)."""
        return self._channel_state()["outputs"]

    @property
    def _extra_output_to_caller(self) -> list[bool]:
        """Per extra-output slot, whether the caller receives it."""
        return self._channel_state()["to_caller"]

    @property
    def _extra_tensor_channels_locked(self) -> bool:
        """True once a fuser has captured this op's bindings."""
        return self._channel_state()["locked"]

    def _lock_extra_tensor_channels(self) -> None:
        self._channel_state()["locked"] = True

    def _check_channels_unlocked(self) -> None:
        if self._extra_tensor_channels_locked:
            raise RuntimeError(
                f"cannot change the extra tensor channels of {type(self).__name__}: an "
                "OperationFuser has already captured its channel routing. Build new ops, bind "
                "their channels, then build a new OperationFuser or Sequential."
            )

    @staticmethod
    def _check_slot(index: Any, count: int, what: str, op: str) -> None:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
            raise IndexError(f"{what} index {index!r} is out of range for {op} with {count} {what}s")

    @staticmethod
    def _check_name(channel: Any, what: str) -> None:
        if channel is not None and (not isinstance(channel, str) or not channel):
            raise ValueError(f"{what} channel must be a non-empty string or None, got {channel!r}")

    def set_extra_input_channel(self, index: int, channel: Optional[str]) -> "ExtraTensorChannels":
        """Feed extra input ``index`` from the extra output bound to ``channel`` by an
        earlier op of the same fuser, instead of from the caller; ``None`` unbinds.
        Binding again replaces the previous name. Returns the op."""
        self._check_slot(index, self.num_extra_inputs, "extra input", type(self).__name__)
        self._check_name(channel, "extra input")
        self._check_channels_unlocked()
        self._extra_input_channels[index] = channel
        return self

    def set_extra_output_channel(
        self, index: int, channel: Optional[str], *, output_to_caller: bool = True
    ) -> "ExtraTensorChannels":
        """Publish extra output ``index`` on ``channel`` for later ops of the same fuser.

        With ``output_to_caller=False`` the caller does not receive it (the fuser's
        output tuple shrinks). ``channel=None`` unbinds and makes it public again.
        Returns the op.
        """
        self._check_slot(index, self.num_extra_outputs, "extra output", type(self).__name__)
        self._check_name(channel, "extra output")
        if not isinstance(output_to_caller, bool):
            raise TypeError(f"output_to_caller must be a bool, got {type(output_to_caller).__name__}")
        self._check_channels_unlocked()
        self._extra_output_channels[index] = channel
        self._extra_output_to_caller[index] = True if channel is None else output_to_caller
        return self


class ChannelRouting:
    """Where each extra tensor of a fuser's basic ops comes from and goes to.

    Attributes (indices are basic-op positions in the fuser):

    * ``input_sources[i][k]``: the producer slot feeding extra input ``k`` of op ``i``,
      or None when the caller passes it;
    * ``output_channels[i][k]`` / ``output_to_caller[i][k]``: the binding of extra
      output ``k`` of op ``i``;
    * ``output_consumers[i][k]``: the ops reading that output through its channel;
    * ``external_input_slots``: the slots the caller fills, in the order the caller
      passes them (op order, then slot order);
    * ``public_output_slots``: the slots returned to the caller, in that order.
    """

    def __init__(self, basic_ops: Sequence[Any]) -> None:
        self.input_sources: list[list[Optional[Slot]]] = [[None] * op.num_extra_inputs for op in basic_ops]
        self.output_channels: list[list[Optional[str]]] = [list(op._extra_output_channels) for op in basic_ops]
        self.output_to_caller: list[list[bool]] = [list(op._extra_output_to_caller) for op in basic_ops]
        self.output_consumers: list[list[list[int]]] = [
            [[] for _ in range(op.num_extra_outputs)] for op in basic_ops
        ]
        self.external_input_slots: list[Slot] = []
        self.public_output_slots: list[Slot] = []

        producers: dict[str, Slot] = {}
        for i, channels in enumerate(self.output_channels):
            for k, name in enumerate(channels):
                if name is None:
                    continue
                if name in producers:
                    raise ValueError(
                        f"extra tensor channel {name!r} has multiple producers "
                        f"(ops {producers[name][0]} and {i}); expected one per fuser"
                    )
                producers[name] = (i, k)

        for i, op in enumerate(basic_ops):
            for k, name in enumerate(op._extra_input_channels):
                if name is None:
                    self.external_input_slots.append((i, k))
                    continue
                producer = producers.get(name)
                where = f"extra tensor channel {name!r} consumed by op {i} ({type(op).__name__})"
                if producer is None:
                    raise ValueError(f"{where} has no producer in this fuser")
                if producer[0] >= i:
                    raise ValueError(
                        f"{where} has no earlier producer (op {producer[0]} produces it; "
                        "channels only connect forward)"
                    )
                self.input_sources[i][k] = producer
                self.output_consumers[producer[0]][producer[1]].append(i)

        for i, flags in enumerate(self.output_to_caller):
            self.public_output_slots.extend((i, k) for k, public in enumerate(flags) if public)

    # ---- forward ---------------------------------------------------------

    def place_external_inputs(self, extra_inputs: Sequence[Any]) -> list[list[Optional[torch.Tensor]]]:
        """Per basic op, its extra inputs: the caller's tensors in their slots, None in
        channel-fed slots (filled by :meth:`fill_channel_inputs` as producers run)."""
        per_op: list[list[Optional[torch.Tensor]]] = [[None] * len(s) for s in self.input_sources]
        for tensor, (i, k) in zip(extra_inputs, self.external_input_slots):
            per_op[i][k] = tensor
        return per_op

    def fill_channel_inputs(
        self,
        idxs: Sequence[int],
        per_op_inputs: list[list[Optional[torch.Tensor]]],
        extra_outputs: Sequence[Optional[Sequence[Optional[torch.Tensor]]]],
        requires_grad: bool,
    ) -> None:
        """Before the (fused) op covering basic ops ``idxs`` runs: give each channel-fed
        input the tensor its producer made. A producer inside the same fused op is left
        to it (the slot stays None: the fused op wires that channel itself).

        Inside the fuser's autograd function grad mode is off, so a tensor a producer
        made fresh does not require grad; when gradients are needed the consumer gets an
        alias that does, so it computes the channel's gradient (as Transformer Engine's
        fuser marks extra outputs)."""
        for i in idxs:
            for k, (producer, slot) in ((k, src) for k, src in enumerate(self.input_sources[i]) if src is not None):
                if producer in idxs:
                    continue
                produced = extra_outputs[producer]
                assert produced is not None, "a producer runs before its consumers"
                value = produced[slot]
                if requires_grad and value.is_floating_point() and not value.requires_grad:
                    value = value.detach().requires_grad_(True)
                per_op_inputs[i][k] = value

    def check_produced(self, op_name: str, idxs: Sequence[int], outputs: Sequence[Sequence[Optional[torch.Tensor]]]) -> None:
        """A fused op may leave an extra output None only when nobody outside it needs it:
        not the caller, not a consumer in another fused op."""
        for i, outs in zip(idxs, outputs):
            for k, value in enumerate(outs):
                if value is not None:
                    continue
                if self.output_to_caller[i][k]:
                    raise RuntimeError(f"op {i} extra output {k} is public, but {op_name} returned None")
                if any(c not in idxs for c in self.output_consumers[i][k]):
                    raise RuntimeError(
                        f"op {i} extra output {k} is required by an operation outside its forward "
                        f"fusion, but {op_name} returned None"
                    )

    def public_outputs(self, extra_outputs: Sequence[Optional[Sequence[Optional[torch.Tensor]]]]) -> list[torch.Tensor]:
        """The extra outputs the caller receives, in ``public_output_slots`` order."""
        return [extra_outputs[i][k] for i, k in self.public_output_slots]  # type: ignore[index]

    # ---- backward --------------------------------------------------------

    def place_output_grads(self, grads: Sequence[Optional[torch.Tensor]]) -> list[list[Optional[torch.Tensor]]]:
        """Per basic op, the caller's gradients of its extra outputs (None: not public)."""
        per_op: list[list[Optional[torch.Tensor]]] = [[None] * len(c) for c in self.output_channels]
        for grad, (i, k) in zip(grads, self.public_output_slots):
            per_op[i][k] = grad
        return per_op

    def add_channel_grads(
        self,
        idxs: Sequence[int],
        per_op_grads: list[list[Optional[torch.Tensor]]],
        channel_grads: dict[str, torch.Tensor],
    ) -> None:
        """Before the backward of the (fused) op covering ``idxs``: add the gradients its
        channels' consumers produced to each produced output's gradient."""
        for i in idxs:
            for k, consumers in enumerate(self.output_consumers[i]):
                grad = channel_grads.get(self.output_channels[i][k]) if consumers else None
                if grad is not None:
                    own = per_op_grads[i][k]
                    per_op_grads[i][k] = grad if own is None else own + grad

    def collect_channel_grads(
        self,
        idxs: Sequence[int],
        grads: Sequence[Sequence[Optional[torch.Tensor]]],
        channel_grads: dict[str, torch.Tensor],
    ) -> None:
        """After that backward: sum the gradients of its channel-fed inputs per channel
        (a producer inside the same fused op got them from the fused op itself)."""
        for i, per_input in zip(idxs, grads):
            for k, grad in enumerate(per_input):
                source = self.input_sources[i][k]
                if source is None or grad is None or source[0] in idxs:
                    continue
                name = self.output_channels[source[0]][source[1]]
                assert name is not None
                prev = channel_grads.get(name)
                channel_grads[name] = grad if prev is None else prev + grad

    def external_input_grads(self, grads: Sequence[Optional[Sequence[Optional[torch.Tensor]]]]) -> list[Optional[torch.Tensor]]:
        """Gradients of the caller's extra inputs, in ``external_input_slots`` order."""
        return [None if grads[i] is None else grads[i][k] for i, k in self.external_input_slots]  # type: ignore[index]
