"""Logprobs in OpenAI's response formats, from the engine's outputs: the legacy completions format
(tokens, token_logprobs, top_logprobs, text_offset; with echo, the prompt's part first), chat's
content list, and vLLM's prompt_logprobs. as_ids (vLLM's return_tokens_as_token_ids): tokens are
named "token_id:<id>" instead of by their text, so tokens that are not whole characters stay apart."""

from __future__ import annotations

from collections.abc import Callable

from arcserve.outputs import CompletionOutput, RequestOutput


def _name(tid: int, e, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids else (e.decoded_token or "")


def completion(o: CompletionOutput, offset: int, k: int, as_ids: bool = False) -> dict | None:
    """Legacy logprobs of the generated tokens, their text offsets counted from `offset`."""
    if o.logprobs is None:
        return None
    toks, lps, tops, offs = [], [], [], []
    for tid, entries in zip(o.token_ids, o.logprobs):
        s = _name(tid, entries[tid], as_ids)
        toks.append(s)
        lps.append(entries[tid].logprob)
        tops.append(_top_dict(_top_with(entries, tid, k), as_ids))
        offs.append(offset)
        offset += len(s)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def prompt_part(token_ids: list[int], prompt_logprobs: list | None, k: int, token_str: Callable[[int], str],
                as_ids: bool = False) -> dict:  # fmt: skip
    """Legacy logprobs of the prompt tokens (the first has none), for echo; token_str gives the text
    of a token that has no entries (detokenizer.TokenTexts)."""
    toks, lps, tops, offs, off = [], [], [], [], 0
    for tid, entries in zip(token_ids, prompt_logprobs or [None] * len(token_ids)):
        if as_ids:
            s = f"token_id:{tid}"
        else:
            s = entries[tid].decoded_token if entries is not None else token_str(tid)
        toks.append(s)
        offs.append(off)
        off += len(s)
        if entries is None:
            lps.append(None)
            tops.append(None)
        else:
            lps.append(entries[tid].logprob)
            tops.append(_top_dict(_top_with(entries, tid, k), as_ids))
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def joined(a: dict, b: dict) -> dict:
    """Legacy logprobs of a then b, b's text offsets shifted past a's text."""
    shift = (a["text_offset"][-1] + len(a["tokens"][-1])) if a["tokens"] else 0
    return {"tokens": a["tokens"] + b["tokens"], "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
            "top_logprobs": a["top_logprobs"] + b["top_logprobs"],
            "text_offset": a["text_offset"] + [x + shift for x in b["text_offset"]]}  # fmt: skip


def echoed(out: RequestOutput, o: CompletionOutput, k: int | None, token_str: Callable[[int], str],
           as_ids: bool = False) -> dict | None:  # fmt: skip
    """Legacy logprobs of prompt and completion together (echo); None without logprobs."""
    if k is None:
        return None
    return joined(prompt_part(out.prompt_token_ids, out.prompt_logprobs, k, token_str, as_ids),
                  completion(o, 0, k, as_ids))  # fmt: skip


def chat(o: CompletionOutput, k: int, as_ids: bool = False) -> dict | None:
    """Chat's logprobs: per token its text, logprob and UTF-8 bytes, with the k most likely."""
    if o.logprobs is None:
        return None
    content = []
    for tid, entries in zip(o.token_ids, o.logprobs):
        def item(t, e):
            s = _name(t, e, as_ids)
            return {"token": s, "logprob": e.logprob, "bytes": list(s.encode())}

        top = sorted(entries.items(), key=lambda te: te[1].rank)[:k]
        content.append({**item(tid, entries[tid]), "top_logprobs": [item(t, e) for t, e in top]})
    return {"content": content}


def prompt(out: RequestOutput, k: int) -> list:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: {logprob, rank,
    decoded_token}} for the prompt's own token and the k most likely."""
    result = []
    for tid, entries in zip(out.prompt_token_ids, out.prompt_logprobs or [None] * len(out.prompt_token_ids)):
        if entries is None:
            result.append(None)
            continue
        keep = {tid: entries[tid], **{t: e for t, e in entries.items() if e.rank <= k}}
        result.append({str(t): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.decoded_token}
                       for t, e in keep.items()})  # fmt: skip
    return result


def _top_with(entries: dict, tid: int, k: int) -> list:
    """(id, entry) of the k most likely, plus the chosen token's when it is not among them (the
    legacy completions format: up to logprobs + 1 entries, the chosen token always there, as vLLM's)."""
    top = sorted(entries.items(), key=lambda te: te[1].rank)[:k]
    return top if any(t == tid for t, _ in top) else top + [(tid, entries[tid])]


def _top_dict(top, as_ids: bool = False) -> dict[str, float]:
    """Legacy top_logprobs: text -> logprob, best first; tokens that decode alike keep the best."""
    d: dict[str, float] = {}
    for t, e in top:
        d.setdefault(_name(t, e, as_ids), e.logprob)
    return d
