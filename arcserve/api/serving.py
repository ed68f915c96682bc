"""/v1/completions and /v1/chat/completions: requests in, engine streams out, OpenAI JSON / SSE back."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from arcserve.api import constraints, logprobs, tools
from arcserve.api.errors import APIError, ClientDisconnected, bad_request, stream_error
from arcserve.api.protocol import ChatCompletionRequest, CompletionRequest
from arcserve.api.streams import finals, merged
from arcserve.beam_search import check_width, request_output, search_each
from arcserve.engine.async_engine import AsyncLLM, RequestStream
from arcserve.engine.detokenizer import TokenTexts
from arcserve.outputs import CompletionOutput, RequestOutput
from arcserve.sampling_params import SamplingParams

# Prompts longer than this (characters) are tokenized, and chats rendered, in a worker thread: a
# megabyte takes the tokenizer seconds, during which the event loop would serve no one else.
OFFLOAD_CHARS = 32_768


_LINE_BREAKS = {0x2028: "\\u2028", 0x2029: "\\u2029", 0x85: "\\u0085"}


async def off_loop(size: int, fn, *args):
    """fn(*args) here when `size` (characters, or token ids) is small, else in a worker thread."""
    return fn(*args) if size < OFFLOAD_CHARS else await asyncio.to_thread(fn, *args)


logger = logging.getLogger("arcserve")


class Serving:
    def __init__(self, engine: AsyncLLM, model_name: str, trust_request_chat_template: bool = False,
                 chat_template_content_format: str = "auto", log_requests: bool = False,
                 max_log_len: int | None = None, response_role: str = "assistant",
                 tokens_as_ids: bool = False, default_template_kwargs: dict | None = None) -> None:  # fmt: skip
        """log_requests: log each request as it arrives (vLLM's --enable-log-requests), its prompt
        text and ids cut to max_log_len characters and ids (None: whole). response_role: the role of
        chat answers to a conversation given a generation prompt (vLLM's --response-role).
        tokens_as_ids: logprobs name tokens "token_id:<id>" for every request
        (--return-tokens-as-token-ids; a request's return_tokens_as_token_ids does it for that one).
        default_template_kwargs: template variables every chat request gets unless it sets them
        (--default-chat-template-kwargs, e.g. {"enable_thinking": false})."""
        self.response_role = response_role
        self.default_template_kwargs = dict(default_template_kwargs or {})
        self.tokens_as_ids = tokens_as_ids
        self.trust_request_chat_template = trust_request_chat_template
        self.content_format = chat_template_content_format
        self.log_requests, self.max_log_len = log_requests, max_log_len
        self.engine = engine
        self.llm = engine.engine
        self.model_name = model_name
        self.tokenizer = self.llm.tokenizer
        self.llm.grammars.warm()  # (structured outputs: checked here before they are queued)
        self._token_str = TokenTexts(self.tokenizer)  # text of one token id, decoded once per id

    # ---- shared --------------------------------------------------------------------------------
    def _tokenize(self, prompts: list, truncate: int | None = None, max_tokens: int | None = None,
                  add_special_tokens: bool = True) -> list[dict]:  # fmt: skip
        """Token ids (and text) of each prompt, cut to its last `truncate` tokens when asked
        (truncate_prompt_tokens: before the length checks, as the engine would)."""
        out = []
        for p in prompts:
            text, ids = self.llm.prompt_tokens(p, truncate, max_tokens, add_special_tokens)
            out.append({"prompt_token_ids": ids, "prompt": text})
        return out

    def request_template(self, body, chat_template: str | None) -> str | None:
        """The template a chat (or /tokenize) request renders with: its own only where the server
        trusts request templates (vLLM's rule), else the server's."""
        if body.chat_template is None:
            return chat_template
        if not self.trust_request_chat_template:
            raise APIError(400, "chat_template in a request needs a server started with "
                           "--trust-request-chat-template (as in vLLM)", param="chat_template")  # fmt: skip
        return body.chat_template

    def template_kwargs(self, body) -> dict:
        """The template variables of a chat (or /tokenize) request: the server's defaults
        (--default-chat-template-kwargs) under the request's chat_template_kwargs; a reasoning_effort
        is passed on too, and turns thinking on or off (enable_thinking: not for "none") unless the
        request's kwargs set it, as vLLM does."""
        own = body.chat_template_kwargs or {}
        kw = {**self.default_template_kwargs, **own}
        effort = getattr(body, "reasoning_effort", None)
        if effort is not None:
            kw["reasoning_effort"] = effort
            if "enable_thinking" not in own:
                kw["enable_thinking"] = effort != "none"
        return kw

    async def render_chat(self, body, chat_template: str | None) -> tuple[str, list[int]]:
        """The request's messages through the chat template: (text, token ids); a long chat is
        rendered off the event loop; a template that fails on them is a 400."""
        kwargs = self.template_kwargs(body)
        messages = [m.as_template_dict() for m in body.messages]
        special = bool(body.add_special_tokens)  # (a tokenize request's None: False for messages, as vLLM)
        args = (messages, chat_template, body.add_generation_prompt, kwargs, body.continue_final_message, special,
                body.tools, self.content_format)  # fmt: skip
        try:
            return await off_loop(sum(len(m.text) for m in body.messages), self.llm.apply_chat_template, *args)
        except ValueError as e:
            raise bad_request(e) from e

    def _log_request(self, what: str, p: dict, params) -> None:
        cut = slice(self.max_log_len)
        text = p.get("prompt")
        logger.info("Received %s: prompt: %r, params: %s, prompt_token_ids: %s", what,
                    None if text is None else text[cut], params, p["prompt_token_ids"][cut])  # fmt: skip

    def _start(self, prompts: list, params_for, req: Request, priority: int, stream: bool,
               step: bool = False) -> list[RequestStream]:  # fmt: skip
        """Queue one engine request per prompt; all or nothing (a bad prompt aborts the others).
        step: the requests are a beam search's step (admitted with it, and logged with it)."""
        base = f"{uuid.uuid4().hex}"
        items = [(p, params_for(p), f"{base}-{i}") for i, p in enumerate(prompts)]
        if self.log_requests and not step:
            for p, params, rid in items:
                self._log_request(f"request {rid}", p, params)
        try:
            return self.engine.add_requests(items, priority, stream, admitted=step)
        except ValueError as e:
            raise bad_request(e) from e

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        """The request's max_tokens, as vLLM's server sets it: refused above max_model_len, else
        capped by what the context has room for after the prompt (the output then ends with
        finish_reason "length") and by the model's generation_config max_new_tokens."""
        limit = self.llm.max_model_len
        if requested is not None and requested > limit:
            raise APIError(
                400, f"max_tokens={requested} cannot be greater than this model's maximum context length "
                f"(max_model_len={limit}); ask for fewer output tokens.",
                param="max_tokens", code="context_length_exceeded",
            )  # fmt: skip
        if prompt_len >= limit:
            raise APIError(
                400, f"The prompt has {prompt_len} tokens but this model's maximum context length "
                f"(max_model_len) is {limit}; the prompt plus at least one generated token must fit.",
                param="prompt", code="context_length_exceeded",
            )  # fmt: skip
        # the model's generation_config max_new_tokens caps every request, as in vLLM's server
        cap = self.llm.generation_defaults.sampling.get("max_tokens")
        return min(x for x in (requested, cap, limit - prompt_len) if x is not None)

    async def _beam_search(self, prompts: list[dict], body, raw: Request, requested: int | None) -> list[RequestOutput]:
        """use_beam_search (vLLM's; n is the beam width): the offline search (arcserve/beam_search.py)
        for each prompt, side by side, each step's requests through the engine as any request's; one
        RequestOutput a prompt, its n best sequences as the choices. The search is admitted once; a
        refused step, or a client gone, ends every prompt's search (their requests aborted)."""
        if requested == 0:  # (echo with max_tokens 0: nothing to search)
            raise APIError(400, "max_tokens must be at least 1 with use_beam_search", param="max_tokens")
        defaults = self.llm.generation_defaults.sampling
        try:
            check_width(self.llm, body.n, "n")
            params = [body.to_beam_search_params(defaults, self._max_tokens(requested, len(p["prompt_token_ids"])))
                      for p in prompts]  # fmt: skip
            self.engine.admit(body.n * len(prompts))  # (its steps then pass add_requests(admitted=True))
        except ValueError as e:
            raise bad_request(e) from e
        if self.log_requests:
            for i, (p, bp) in enumerate(zip(prompts, params)):
                self._log_request(f"beam search {i + 1} of {len(prompts)}", p, bp)

        async def run(reqs: list[dict], step: SamplingParams) -> list[RequestOutput]:
            if await raw.is_disconnected():  # (a step can end before finals' first poll)
                raise ClientDisconnected
            return await finals(self._start(reqs, lambda _r: step, raw, body.priority, False, step=True), raw)

        outs = await search_each(self.llm, [(p["prompt_token_ids"], bp) for p, bp in zip(prompts, params)], run)
        with_logprobs = body.logprobs is not None and body.logprobs is not False  # (chat: a bool; completions: a count)
        return [request_output(o, p["prompt_token_ids"], p.get("prompt"), bp, self.tokenizer, with_logprobs)
                for o, p, bp in zip(outs, prompts, params)]  # fmt: skip

    @staticmethod
    def _usage(prompt_lens: list[int], completion: int) -> dict:
        p = sum(prompt_lens)
        return {"prompt_tokens": p, "completion_tokens": completion, "total_tokens": p + completion}

    @staticmethod
    def _sse(obj) -> str:
        # U+2028, U+2029 and U+0085 are line breaks to str.splitlines(), which some SSE clients use:
        # written as JSON escapes, an event stays one line for them too.
        return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"

    # ---- completions ---------------------------------------------------------------------------
    @staticmethod
    def _refuse_unsupported(body) -> None:
        got = body.unsupported()
        if got is not None:
            raise APIError(400, got[1], param=got[0], code="unsupported")

    def _logprob_counts(self, body, *names: str) -> None:
        """The body's logprobs counts as the engine reads them: -1 is the whole vocabulary; above
        --max-logprobs a 400 naming the parameter."""
        for name in names:
            try:
                setattr(body, name, self.llm.logprobs_count(name, getattr(body, name)))
            except ValueError as e:
                raise bad_request(e) from e

    async def completions(self, body: CompletionRequest, raw: Request):
        self._refuse_unsupported(body)
        self._logprob_counts(body, "logprobs", "prompt_logprobs")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of must equal n (or be left out)", param="best_of")
        structured = await constraints.checked(body, self.llm.grammars)
        try:  # tokenize once; the engine gets token ids
            todo = body.prompts()
            prompts = await off_loop(sum(len(p) for p in todo if isinstance(p, str)), self._tokenize, todo,
                                     body.truncate_prompt_tokens, body.max_tokens, body.add_special_tokens)  # fmt: skip
        except ValueError as e:
            raise bad_request(e) from e
        plens = [len(p["prompt_token_ids"]) for p in prompts]
        defaults = self.llm.generation_defaults.sampling

        def params_for(p):
            mt = self._max_tokens(1 if body.echo_only else body.max_tokens, len(p["prompt_token_ids"]))
            try:  # echo with logprobs and prompt_logprobs both need the prompt's logprobs
                wanted = [x for x in (body.logprobs if body.echo else None, body.prompt_logprobs) if x is not None]
                return body.to_sampling_params(defaults, mt, body.logprobs, max(wanted, default=None), structured)
            except ValueError as e:
                raise bad_request(e) from e

        beams = body.use_beam_search  # (never streamed: protocol's unsupported())
        streams = None if beams else self._start(prompts, params_for, raw, body.priority, body.stream)
        as_ids = self._as_ids(body)
        echo = [self._prompt_text(p) if body.echo else "" for p in prompts]
        rid, created, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), body.n
        if body.stream:
            return StreamingResponse(
                self._stream_completions(streams, rid, created, n, echo, plens, _usage_mode(body), body.logprobs or 0,
                                         body.echo_only, body.return_token_ids, as_ids),
                media_type="text/event-stream",
            )
        if beams:
            outs = await self._beam_search(prompts, body, raw, 1 if body.echo_only else body.max_tokens)
        else:
            outs = await finals(streams, raw)
        choices, completion = [], 0
        for i, out in enumerate(outs):
            for o in out.outputs:
                o = _nothing_generated(o) if body.echo_only else o
                completion += len(o.token_ids)
                choices.append({
                    "index": i * n + o.index, "text": echo[i] + o.text,
                    "logprobs": logprobs.echoed(out, o, body.logprobs, self._token_str, as_ids) if body.echo
                    else logprobs.completion(o, 0, body.logprobs or 0, as_ids),
                    "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
                    **({"prompt_logprobs": logprobs.prompt(out, body.prompt_logprobs)}
                       if body.prompt_logprobs is not None else {}),
                    **({"prompt_token_ids": out.prompt_token_ids, "token_ids": list(o.token_ids)}
                       if body.return_token_ids else {}),
                })  # fmt: skip
        choices.sort(key=lambda c: c["index"])
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": self._usage(plens, completion)})  # fmt: skip

    def _as_ids(self, body) -> bool:
        return bool(body.return_tokens_as_token_ids) or self.tokens_as_ids

    def _prompt_text(self, p: dict) -> str:
        return p["prompt"] if p["prompt"] is not None else self.tokenizer.decode(p["prompt_token_ids"])

    async def _stream_completions(self, streams, rid, created, n, echo, plens, usage_mode, k, echo_only=False,
                                  token_ids=False, as_ids=False):  # fmt: skip
        """usage_mode: None, "final" (a last chunk with the usage) or "every" (also in every chunk).
        echo_only: echo with max_tokens 0, the one token the engine made left out. token_ids
        (return_token_ids): each chunk's new token ids, a choice's first chunk the prompt's too."""
        completion = 0
        per_choice: dict[int, int] = {}
        echoed: set[int] = set()  # choices whose first chunk (the prompt's text and logprobs) went out
        ids_sent: set[int] = set()  # choices whose prompt_token_ids went out (return_token_ids)
        offsets: dict[int, int] = {}
        # Each prompt's logprobs come with its first delta only; a choice whose first tokens come in
        # a later delta (its prompt computed a step later) echoes them from there.
        prompt_lps: dict[int, list] = {}
        try:
            async for i, out in merged(streams):
                if out.prompt_logprobs is not None:
                    prompt_lps.setdefault(i, out.prompt_logprobs)
                for o in out.outputs:
                    o = _nothing_generated(o) if echo_only else o
                    idx = i * n + o.index
                    first_echo = bool(echo[i]) and idx not in echoed
                    if first_echo:
                        echoed.add(idx)
                    text = echo[i] + o.text if first_echo else o.text
                    completion += len(o.token_ids)
                    per_choice[idx] = per_choice.get(idx, 0) + len(o.token_ids)
                    # Offsets follow the tokens' own text (the streamed text is held back while a
                    # character or a possible stop string is incomplete).
                    start = 0 if first_echo else offsets.get(idx, 0)
                    lp = logprobs.completion(o, start, k, as_ids)
                    if lp is not None:
                        if first_echo:  # first chunk: the prompt's logprobs too, the tokens' offsets after them
                            part = logprobs.prompt_part(out.prompt_token_ids, prompt_lps.get(i), k, self._token_str,
                                                        as_ids)  # fmt: skip
                            lp = logprobs.joined(part, lp)
                        offsets[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else start
                    choice = {"index": idx, "text": text, "logprobs": lp, "finish_reason": o.finish_reason,
                              "stop_reason": o.stop_reason}  # fmt: skip
                    if token_ids:
                        if idx not in ids_sent:
                            ids_sent.add(idx)
                            choice["prompt_token_ids"] = out.prompt_token_ids
                        choice["token_ids"] = list(o.token_ids)
                    yield self._sse({
                        "id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                        "choices": [choice],
                        # (every chunk: its own choice's usage so far, as vLLM reports it)
                        **({"usage": self._usage([plens[i]], per_choice[idx])} if usage_mode == "every" else {}),
                    })  # fmt: skip
            if usage_mode:
                yield self._sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                                 "choices": [], "usage": self._usage(plens, completion)})  # fmt: skip
        except Exception as e:  # after the headers went out, errors travel in the stream
            yield self._sse(stream_error(e))
        yield "data: [DONE]\n\n"

    # ---- chat ----------------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, raw: Request, chat_template: str | None):
        self._refuse_unsupported(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        self._logprob_counts(body, "top_logprobs", "prompt_logprobs")
        structured = await constraints.checked(body, self.llm.grammars)
        chat_template = self.request_template(body, chat_template)
        requested = body.max_completion_tokens or body.max_tokens
        text, ids = self.llm.truncate_prompt(*await self.render_chat(body, chat_template),
                                             body.truncate_prompt_tokens, requested)  # fmt: skip
        prompt = {"prompt_token_ids": ids, "prompt": text}
        k = body.top_logprobs or 0
        mt = self._max_tokens(requested, len(ids))
        try:
            params = body.to_sampling_params(self.llm.generation_defaults.sampling, mt, k if body.logprobs else None,
                                             body.prompt_logprobs, structured)  # fmt: skip
        except ValueError as e:
            raise bad_request(e) from e
        beams = body.use_beam_search  # (never streamed: protocol's unsupported())
        streams = None if beams else self._start([prompt], lambda _p: params, raw, body.priority, body.stream)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        # The answer's role: the server's response role after a generation prompt, else the last
        # message's (it is continued). echo (vLLM): that message's text in front of the answer when
        # it has the answer's role.
        last = body.messages[-1]
        role = self.response_role if body.add_generation_prompt else last.role
        echo = last.text if body.echo and last.role == role else ""
        call = body.forced_call  # a tool call the request forces: the answer's tool_calls (api/tools.py)
        echo = echo if call is None else ""  # (a forced call's answer is the call, whatever the last message)
        if body.stream:
            return StreamingResponse(self._stream_chat(streams, rid, created, body.n, len(ids), _usage_mode(body), k,
                                                       echo, role, ids if body.return_token_ids else None,
                                                       self._as_ids(body), call),
                                     media_type="text/event-stream")  # fmt: skip
        (out,) = await (self._beam_search([prompt], body, raw, requested) if beams else finals(streams, raw))
        choices = []
        for o in out.outputs:
            message, reason = {"role": role, "content": o.text}, o.finish_reason
            if call is not None:
                message, reason = tools.message(call, role, o.text, o.finish_reason)
            else:
                message["content"] = echo + message["content"]
            choices.append({
                "index": o.index, "message": message, "logprobs": logprobs.chat(o, k, self._as_ids(body)),
                "finish_reason": reason, "stop_reason": o.stop_reason,
                **({"token_ids": list(o.token_ids)} if body.return_token_ids else {}),
            })  # fmt: skip
        completion = sum(len(o.token_ids) for o in out.outputs)
        extra = {"prompt_logprobs": logprobs.prompt(out, body.prompt_logprobs)} if body.prompt_logprobs is not None else {}
        if body.return_token_ids:
            extra["prompt_token_ids"] = ids
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": self._usage([len(ids)], completion), **extra})  # fmt: skip

    async def _stream_chat(self, streams, rid, created, n, plen, usage_mode, k, echo="", role="assistant",
                           prompt_ids=None, as_ids=False, call=None):  # fmt: skip
        """prompt_ids (return_token_ids): in the first chunk; each chunk then carries its new token ids.
        call: a forced tool call (api/tools.py), streamed as tool_calls deltas."""
        def chunk(choices, **extra):
            if usage_mode == "every" and "usage" not in extra:  # the chunk's choice's usage so far (vLLM)
                extra["usage"] = self._usage([plen], per_choice.get(choices[0]["index"], 0) if len(choices) == 1 else 0)
            return self._sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                              "model": self.model_name, "choices": choices, **extra})  # fmt: skip

        completion = 0
        per_choice: dict[int, int] = {}
        calls: dict[int, tools.StreamedCalls] = {}
        try:
            yield chunk([{"index": i, "delta": {"role": role, "content": echo}, "logprobs": None,
                          "finish_reason": None} for i in range(n)],
                        **({"prompt_token_ids": prompt_ids} if prompt_ids is not None else {}))  # fmt: skip
            async for _i, out in merged(streams):
                for o in out.outputs:
                    completion += len(o.token_ids)
                    per_choice[o.index] = per_choice.get(o.index, 0) + len(o.token_ids)
                    delta, reason = {"content": o.text} if o.text else {}, o.finish_reason
                    if call is not None:
                        delta, reason = calls.setdefault(o.index, tools.StreamedCalls(call)).delta(o.text, reason)
                    if not delta and reason is None and o.logprobs is None and prompt_ids is None:
                        continue  # a token that completes no character (or call) yet: nothing to send
                    choice = {"index": o.index, "delta": delta, "logprobs": logprobs.chat(o, k, as_ids),
                              "finish_reason": reason, "stop_reason": o.stop_reason}  # fmt: skip
                    if prompt_ids is not None:
                        choice["token_ids"] = list(o.token_ids)
                    yield chunk([choice])
            if usage_mode:
                yield chunk([], usage=self._usage([plen], completion))
        except Exception as e:
            yield self._sse(stream_error(e))
        yield "data: [DONE]\n\n"


def _usage_mode(body) -> str | None:
    """What a stream reports of usage: None, "final" (include_usage: one last chunk) or "every" (and
    continuous_usage_stats: the usage so far in every chunk too, as vLLM does)."""
    so = body.stream_options
    if not (so and so.include_usage):
        return None
    return "every" if so.continuous_usage_stats else "final"


def _nothing_generated(o: CompletionOutput) -> CompletionOutput:
    """The output without its tokens (echo with max_tokens 0: vLLM's scoring of a prompt)."""
    return dataclasses.replace(o, text="", token_ids=[], logprobs=None if o.logprobs is None else [])
