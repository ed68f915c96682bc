"""Command line: `arcserve generate` (one completion) and friends. Flags use vLLM's names."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from arcserve.argtypes import human_int, ranged
from arcserve.config import KV_CACHE_DTYPES, EngineArgs, _json_dict
from arcserve.platform import DEVICE_CHOICES


def _json_object(text: str) -> dict:
    try:
        return _json_dict(text, "the value")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _lower(text: str) -> str:
    return text.lower()  # (vLLM's log levels are spelled in capitals; ours and uvicorn's in lower case)


def max_model_len_arg(text: str) -> int | None:
    """human_int, or -1 / auto: the model's own length (the default)."""
    return None if text.strip().lower() in ("auto", "-1") else human_int(text)


def _bool_flag(p: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    p.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=default, help=help)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags; each maps one to one onto an EngineArgs field (dashes -> underscores)."""
    p.add_argument("model", nargs="?", default=None, help="Hugging Face model folder (default: bundled demo model)")
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL", help="the model folder, as a flag")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    _bool_flag(p, "trust-remote-code", False, "let a tokenizer run its own code")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="1 only: one device per model")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    p.add_argument("--max-model-len", type=max_model_len_arg, default=None,
                   help="e.g. 4096, 4k (4,000), 4K (4,096); -1 or auto: the model's own")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=human_int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", dest="num_kv_blocks", type=int, default=None,
                   help="fix the KV cache size in blocks")  # fmt: skip
    p.add_argument("--kv-cache-memory-bytes", type=human_int, default=None, help="e.g. 4G (4 * 2**30 bytes)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="auto: the model dtype; fp8 (= fp8_e4m3) or fp8_e5m2: 8-bit floats, scale 1.0 (half the bytes of bf16)")
    _bool_flag(p, "enable-prefix-caching", True, "reuse KV blocks of shared prompt prefixes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheduling-policy", default="fcfs",
                   help="fcfs | priority | FILE.py:Class | package.module:Class (a SchedulingPolicy subclass)")
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    p.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"],
                   help="auto = Triton on GPUs, PyTorch on CPU")  # fmt: skip
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="GPU: share of device memory for weights, activations and the KV cache")  # fmt: skip
    _bool_flag(p, "enforce-eager", False, "GPU: run every step eagerly, without captured graphs; CPU: no compiled decode kernels")
    p.add_argument("--enable-chunked-prefill", action="store_true", dest="chunked_prefill_flag",
                   help="vLLM's; arcserve always splits long prompts into chunks within --max-num-batched-tokens")  # fmt: skip
    _bool_flag(p, "async-scheduling", None,
               "overlap steps: schedule step N+1 while the device runs step N (default: on for GPUs)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: random weights from config.json alone (benchmarks)")  # fmt: skip
    p.add_argument("--generation-config", default="auto", help="auto | a folder | vllm (ignore the model's)")
    p.add_argument("--override-generation-config", default=None,
                   help='generation_config.json keys over the model\'s, as JSON: \'{"temperature": 0.5}\'')  # fmt: skip
    p.add_argument("--speculative-config", default=None,
                   help='speculative decoding as JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                        '\'{"model": DRAFT_DIR, "num_speculative_tokens": 4}\'')  # fmt: skip
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (throughput, running and waiting requests, KV cache usage)")  # fmt: skip
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs a request may ask for per token; -1: no limit (logprobs=-1, the whole "
                        "vocabulary, then passes)")  # fmt: skip
    p.add_argument("--log-level", default="info", type=_lower, choices=["debug", "info", "warning", "error"])


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    fields = EngineArgs.field_names()
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in fields})


def _generate(ns: argparse.Namespace) -> int:
    from arcserve import LLM

    llm = LLM.from_engine_args(engine_args_from(ns))
    given = {k: getattr(ns, k) for k in ("max_tokens", "temperature", "top_p", "top_k")}
    sp = dataclasses.replace(
        llm.get_default_sampling_params(), **{k: v for k, v in given.items() if v is not None}
    )
    if ns.chat:
        out = llm.chat([{"role": "user", "content": ns.prompt}], sp, use_tqdm=False)
    else:
        out = llm.generate([ns.prompt], sp, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def _bench_serve(ns: argparse.Namespace) -> int:
    from arcserve.bench.serve import main as bench_main

    return bench_main(ns)


def _serve(ns: argparse.Namespace) -> int:
    from arcserve.api.server import run_server
    from arcserve.models.demo import DEMO_NAME

    if ns.served_model_name is None:
        ns.served_model_name = [ns.model or DEMO_NAME]
    run_server(ns, engine_args_from(ns))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arcserve", description="arcserve LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default model: the bundled demo)")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    s.add_argument("--port", type=ranged(int, 0, 65535), default=8000)
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API answers to; responses name the first (default: MODEL_DIR)")  # fmt: skip
    s.add_argument("--api-key", nargs="+", default=None,
                   help="require this bearer key, or any of several (else ARCSERVE_API_KEY or VLLM_API_KEY)")  # fmt: skip
    s.add_argument("--chat-template", default=None, help="a Jinja chat template file, or the template itself")
    s.add_argument("--default-chat-template-kwargs", default=None, type=_json_object,
                   help='template variables for every chat request unless it sets them, as JSON, e.g. \'{"enable_thinking": false}\'')  # fmt: skip
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (rendered in the Jinja sandbox)")  # fmt: skip
    s.add_argument("--chat-template-content-format", choices=["auto", "string", "openai"], default="auto",
                   help="messages' text parts reach the template joined (string) or as parts (openai); auto: "
                        "as parts when the template loops over a message's content")  # fmt: skip
    _bool_flag(s, "enable-log-requests", False, "log each request as it arrives: prompt, token ids and sampling parameters")
    s.add_argument("--disable-log-requests", action="store_true",
                   help="vLLM's older flag; requests are not logged unless --enable-log-requests")  # fmt: skip
    s.add_argument("--max-log-len", type=int, default=None,
                   help="with --enable-log-requests: the most prompt characters and token ids logged")  # fmt: skip
    s.add_argument("--uvicorn-log-level", default=None, type=_lower,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level (default: --log-level)")  # fmt: skip
    s.add_argument("--response-role", default="assistant",
                   help="the role chat answers carry when add_generation_prompt is true (else the last message's)")  # fmt: skip
    s.add_argument("--root-path", default=None,
                   help="the path prefix a reverse proxy serves the API under (e.g. /llm)")  # fmt: skip
    s.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the server's private key file (PEM)")
    s.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the server's certificate chain file (PEM)")
    s.add_argument("--ssl-ca-certs", default=None, help="CA certificates that client certificates are checked against")
    s.add_argument("--ssl-cert-reqs", type=int, default=0,
                   help="client certificates: 0 none (default), 1 optional, 2 required (Python's ssl.CERT_*)")  # fmt: skip
    s.add_argument("--max-waiting-requests", type=ranged(int, 1), default=1024,
                   help="answer 503 while this many requests are waiting")  # fmt: skip
    s.add_argument("--shutdown-timeout", type=ranged(float, 0.0), default=30.0,
                   help="on SIGTERM: seconds the requests in flight get to finish before they are stopped")  # fmt: skip
    s.add_argument("--metrics-require-key", action="store_true", help="with --api-key, /metrics needs the key too")
    s.add_argument("--max-request-body-bytes", type=ranged(int, 1), default=16 << 20,
                   help="larger request bodies get 413 (e.g. 16M)")  # fmt: skip
    s.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    s.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name tokens "token_id:<id>" instead of by their text (every request)')  # fmt: skip
    s.add_argument("--enable-request-id-headers", action="store_true",
                   help="responses carry X-Request-Id (the request's own, else a fresh one)")  # fmt: skip
    s.add_argument("--allowed-origins", default=None,
                   help='CORS: origins allowed to call the API from a browser, as JSON \'["https://a.example"]\' '
                        "or comma-separated (default: CORS off)")  # fmt: skip
    s.add_argument("--allowed-methods", default=None, help="CORS: allowed methods (default GET, POST)")
    s.add_argument("--allowed-headers", default=None, help="CORS: allowed headers (default Authorization, Content-Type)")
    _bool_flag(s, "allow-credentials", False, "CORS: allow credentials")
    s.set_defaults(func=_serve)
    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bs = b.add_parser("serve", help="load an OpenAI-compatible server and report TTFT/TPOT/ITL")
    from arcserve.bench.serve import add_args as add_bench_args

    add_bench_args(bs)
    bs.add_argument("--log-level", default="warning", type=_lower, choices=["debug", "info", "warning", "error"])
    bs.set_defaults(func=_bench_serve)

    g = sub.add_parser("generate", help="print one completion of a prompt")
    add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="default: generation_config.json's max_new_tokens, else 16 (vLLM's SamplingParams default)")  # fmt: skip
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if getattr(ns, "model_flag", None) is not None:  # `--model M` as vLLM takes it too
        if ns.model is not None and ns.model != ns.model_flag:
            parser.error(f"two models given: {ns.model!r} and --model {ns.model_flag!r}")
        ns.model = ns.model_flag
    logging.basicConfig(
        level=getattr(logging, ns.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"arcserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
