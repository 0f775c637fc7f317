"""A handoff record as a flat list of tensors: a header, then every tensor it names.

The wire form is what a transport sends point to point::

    [0] header   uint8 [n]: UTF-8 JSON — magic, version, the request fields, the sampling
                 parameters, the compatibility descriptor, and the manifest: (name, dtype,
                 shape) of every tensor that follows, in order
    [1..]        the slot-state tensors (descriptor layout order), the recurrent state rows,
                 then the draft extras

`decode` checks everything before it builds a record: the magic and version, the count of
tensors, each tensor's dtype and shape against the manifest, the clocks (``committed_len ==
len(prompt) + len(outputs) - 1``, one row per position in every slot-state tensor), the bonus
token, the emitted tokens' logprobs (present exactly when asked for, one per token). A
truncated or corrupted record raises `MalformedRecord` naming what is wrong; nothing
else is raised for bad bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from specstate.core.errors import InvalidRequest, MalformedRecord
from specstate.core.params import SamplingParams
from specstate.core.request import TopLogprobs
from specstate.grammar.spec import Grammar
from specstate.handoff.record import (
    HANDOFF_VERSION,
    ROW,
    CompatibilityDescriptor,
    DraftState,
    HandoffRecord,
)

__all__ = [
    "MAGIC",
    "decode",
    "decode_header",
    "dtype_named",
    "encode",
    "header_tensor",
    "sampling_from",
    "sampling_json",
]

MAGIC = "specstate-handoff"

_DTYPES: dict[str, torch.dtype] = {
    str(d): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
    )
}
_DRAFT = "relay."


def dtype_named(name: str) -> torch.dtype:
    """The dtype ``str(dtype)`` names (``"torch.float32"``).

    Raises:
        MalformedRecord: not a dtype a record may carry.
    """
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise MalformedRecord(f"handoff record names an unknown dtype {name!r}") from None


def sampling_json(sampling: SamplingParams) -> dict[str, Any]:
    """``sampling`` as a JSON object (a record's header; a front door's request)."""
    grammar = sampling.grammar
    return {
        "max_new_tokens": sampling.max_new_tokens,
        "stop_token_ids": sorted(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "speculative": sampling.speculative,
        "repetition_penalty": sampling.repetition_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "min_new_tokens": sampling.min_new_tokens,
        "stop_sequences": [list(s) for s in sampling.stop_sequences],
        "seed": sampling.seed,
        "logprobs": sampling.logprobs,
        "top_logprobs": sampling.top_logprobs,
        "grammar": None if grammar is None else grammar.to_json(),
    }


def sampling_from(value: Any) -> SamplingParams:
    """The `SamplingParams` of `sampling_json`'s object (`MalformedRecord` if it is not one)."""
    if not isinstance(value, dict):
        raise MalformedRecord("handoff record: sampling parameters are not an object")
    fields = dict(value)
    try:
        grammar = fields.pop("grammar", None)
        fields["stop_sequences"] = tuple(tuple(s) for s in fields.get("stop_sequences", ()))
        return SamplingParams(
            **fields, grammar=None if grammar is None else Grammar.from_json(grammar)
        )
    except (TypeError, ValueError, InvalidRequest) as exc:
        raise MalformedRecord(f"handoff record: bad sampling parameters ({exc})") from None


def _or_none(value: Any, convert: Any) -> Any:
    return None if value is None else convert(value)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _logprobs(
    header: dict[str, Any], sampling: SamplingParams, outputs: tuple[int, ...], request_id: str
) -> tuple[tuple[float, ...] | None, tuple[TopLogprobs, ...] | None]:
    """The emitted tokens' log-probabilities and top alternatives, present exactly when the
    sampling parameters ask for them, one per emitted token.

    Raises:
        MalformedRecord: missing, unasked for, or of the wrong length or shape.
    """
    values, top = header.get("output_logprobs"), header.get("output_top_logprobs")
    where = f"request {request_id!r}: handoff record"
    if not sampling.logprobs:
        if values is not None or top is not None:
            raise MalformedRecord(f"{where} carries logprobs its sampling does not ask for")
        return None, None
    if (
        not isinstance(values, list)
        or len(values) != len(outputs)
        or not all(_number(v) for v in values)
    ):
        raise MalformedRecord(
            f"{where} needs one logprob per emitted token ({len(outputs)}), got {values!r}"
        )
    logprobs = tuple(float(v) for v in values)
    k = sampling.top_logprobs
    if not k:
        if top is not None:
            raise MalformedRecord(f"{where} carries top logprobs its sampling does not ask for")
        return logprobs, None
    good = (
        isinstance(top, list)
        and len(top) == len(outputs)
        and all(
            isinstance(pairs, list)
            and len(pairs) == k
            and all(
                isinstance(p, list)
                and len(p) == 2
                and isinstance(p[0], int)
                and not isinstance(p[0], bool)
                and _number(p[1])
                for p in pairs
            )
            for pairs in top
        )
    )
    if not good:
        raise MalformedRecord(
            f"{where} needs {k} top logprobs per emitted token ({len(outputs)}), got {top!r}"
        )
    assert isinstance(top, list)
    pairs = tuple(tuple((int(t), float(v)) for t, v in row) for row in top)
    return logprobs, pairs


def header_tensor(record: HandoffRecord) -> torch.Tensor:
    """The header of ``record``: UTF-8 JSON as a ``uint8`` tensor."""
    d = record.descriptor
    manifest = [
        *([name, str(t.dtype), list(t.shape)] for name, t in record.slot_state.items()),
        *([name, str(t.dtype), list(t.shape)] for name, t in record.recurrent_state.items()),
        *(
            [_DRAFT + name, str(t.dtype), list(t.shape)]
            for name, t in record.draft_state.tensors().items()
        ),
    ]
    header = {
        "magic": MAGIC,
        "version": record.version,
        "request_id": record.request_id,
        "prompt_ids": list(record.prompt_ids),
        "output_ids": list(record.output_ids),
        "committed_len": record.committed_len,
        "bonus_token": record.draft_state.bonus_token,
        "output_logprobs": _or_none(record.output_logprobs, list),
        "output_top_logprobs": _or_none(
            record.output_top_logprobs, lambda top: [[list(p) for p in pairs] for pairs in top]
        ),
        "sampling": sampling_json(record.sampling),
        "descriptor": {
            "model_digest": d.model_digest,
            "drafter_digest": d.drafter_digest,
            "dtype": d.dtype,
            "page_size": d.page_size,
            "layout": [[n, dt, list(s)] for n, dt, s in d.layout],
            "algorithm": d.algorithm,
            "num_steps": d.num_steps,
            "topk": d.topk,
            "library_version": d.library_version,
        },
        "manifest": manifest,
    }
    data = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def encode(record: HandoffRecord) -> list[torch.Tensor]:
    """``record`` as ``[header, *tensors]`` (contiguous CPU-or-device tensors, not copies of
    the header's data)."""
    tensors = [
        *record.slot_state.values(),
        *record.recurrent_state.values(),
        *record.draft_state.tensors().values(),
    ]
    return [header_tensor(record), *(t.contiguous() for t in tensors)]


def decode_header(header: torch.Tensor) -> dict[str, Any]:
    """The header's JSON object, its magic and version checked.

    Raises:
        MalformedRecord: not UTF-8 JSON, not an object, a wrong magic, another version, or no
            manifest.
    """
    if header.dtype is not torch.uint8 or header.dim() != 1:
        raise MalformedRecord(
            f"handoff record: header must be a 1-D uint8 tensor, got {header.dtype} "
            f"{tuple(header.shape)}"
        )
    try:
        value = json.loads(bytes(header.cpu().numpy().tobytes()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedRecord(f"handoff record: header is not JSON ({exc})") from None
    if not isinstance(value, dict) or value.get("magic") != MAGIC:
        raise MalformedRecord("handoff record: header lacks the specstate-handoff magic")
    if value.get("version") != HANDOFF_VERSION:
        raise MalformedRecord(
            f"handoff record: version {value.get('version')!r}, this reader reads {HANDOFF_VERSION}"
        )
    manifest = value.get("manifest")
    if not isinstance(manifest, list) or not all(
        isinstance(m, list) and len(m) == 3 and isinstance(m[0], str) for m in manifest
    ):
        raise MalformedRecord("handoff record: header has no valid manifest")
    return value


def manifest_of(header: dict[str, Any]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The (name, dtype, shape) of every tensor after the header, as the header lists them.

    Raises:
        MalformedRecord: an unknown dtype or a shape that is not a list of sizes.
    """
    out = []
    for name, dtype, shape in header["manifest"]:
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise MalformedRecord(f"handoff record: tensor {name!r} has a bad shape {shape!r}")
        out.append((name, dtype_named(dtype), tuple(shape)))
    return out


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise MalformedRecord(f"handoff record: {what} is not a list of token ids")
    return tuple(value)


def _descriptor(value: Any) -> CompatibilityDescriptor:
    try:
        layout = tuple((str(n), str(dt), tuple(int(x) for x in s)) for n, dt, s in value["layout"])
        return CompatibilityDescriptor(
            model_digest=str(value["model_digest"]),
            drafter_digest=str(value["drafter_digest"]),
            dtype=str(value["dtype"]),
            page_size=int(value["page_size"]),
            layout=layout,
            algorithm=str(value["algorithm"]),
            num_steps=int(value["num_steps"]),
            topk=int(value["topk"]),
            library_version=str(value["library_version"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise MalformedRecord(f"handoff record: bad compatibility descriptor ({exc!r})") from None


def decode(tensors: Sequence[torch.Tensor]) -> HandoffRecord:
    """The record ``tensors`` (as `encode` wrote them) hold, every part checked first.

    Raises:
        MalformedRecord: naming the first problem (module docstring); nothing is built.
    """
    if not tensors:
        raise MalformedRecord("handoff record: no tensors (not even a header)")
    header = decode_header(tensors[0])
    manifest = manifest_of(header)
    body = list(tensors[1:])
    if len(body) != len(manifest):
        raise MalformedRecord(
            f"handoff record: the header lists {len(manifest)} tensors, {len(body)} arrived "
            "(truncated)"
        )
    for (name, dtype, shape), t in zip(manifest, body, strict=True):
        if t.dtype is not dtype or tuple(t.shape) != shape:
            raise MalformedRecord(
                f"handoff record: tensor {name!r} is {t.dtype} {tuple(t.shape)}, the header "
                f"says {dtype} {shape}"
            )
    request_id = header.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise MalformedRecord("handoff record: no request id")
    prompt = _ints(header.get("prompt_ids"), "prompt_ids")
    outputs = _ints(header.get("output_ids"), "output_ids")
    committed = header.get("committed_len")
    if not prompt or not outputs:
        raise MalformedRecord(
            f"request {request_id!r}: handoff record needs a prompt and at least one emitted "
            f"token, got {len(prompt)} and {len(outputs)}"
        )
    if committed != len(prompt) + len(outputs) - 1:
        raise MalformedRecord(
            f"request {request_id!r}: committed_len {committed!r} is not prompt {len(prompt)} + "
            f"outputs {len(outputs)} - 1"
        )
    if header.get("bonus_token") != outputs[-1]:
        raise MalformedRecord(
            f"request {request_id!r}: bonus token {header.get('bonus_token')!r} is not the last "
            f"emitted token {outputs[-1]}"
        )
    descriptor = _descriptor(header.get("descriptor"))
    sampling = sampling_from(header.get("sampling"))
    logprobs, top = _logprobs(header, sampling, outputs, request_id)
    slot_state: dict[str, torch.Tensor] = {}
    rows: dict[str, torch.Tensor] = {}
    draft: dict[str, torch.Tensor] = {}
    for (name, _, shape), t in zip(manifest, body, strict=True):
        if name.startswith(_DRAFT):
            draft[name[len(_DRAFT) :]] = t
            continue
        if name.startswith(ROW):
            rows[name] = t
            continue
        if not shape or shape[0] != committed:
            raise MalformedRecord(
                f"request {request_id!r}: slot state {name!r} has {shape[:1]} rows, committed "
                f"length is {committed}"
            )
        slot_state[name] = t
    layout_names = [n for n, _, _ in descriptor.layout]
    if [*slot_state, *rows] != layout_names:
        raise MalformedRecord(
            f"request {request_id!r}: state {[*slot_state, *rows]} does not follow the "
            f"descriptor's layout {layout_names}"
        )
    unknown = set(draft) - {"hidden_states", "topk_p", "topk_index"}
    if unknown:
        raise MalformedRecord(f"request {request_id!r}: unknown draft state {sorted(unknown)}")
    return HandoffRecord(
        version=HANDOFF_VERSION,
        request_id=request_id,
        prompt_ids=prompt,
        output_ids=outputs,
        sampling=sampling,
        committed_len=committed,
        descriptor=descriptor,
        slot_state=slot_state,
        draft_state=DraftState(bonus_token=outputs[-1], **draft),
        recurrent_state=rows,
        output_logprobs=logprobs,
        output_top_logprobs=top,
    )
