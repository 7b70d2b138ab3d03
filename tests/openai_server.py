"""A small OpenAI-compatible chat server over a real HF model, for exercising the openai backend in tests.

    python tests/openai_server.py --model DIR --port P [--fail-first N --fail-status 429] [--scripted FILE]
                                  [--served-model-name NAME]

Like vLLM and SGLang, `/v1/models` names the model `--served-model-name`, else the `--model` argument, and gives
that argument as the card's `root`.

It generates greedily with transformers (the same model the local backend runs). Failure injection answers
the first N chat requests with `--fail-status`; `--scripted` maps a user prompt to a fixed reply
(`content`, optional `reasoning_content`, optional `delay_s` before answering) to test how replies are parsed
and scheduled, or to a refusal (`status`, e.g. 400, and the error `message`, in vLLM's error body).
Like vLLM and SGLang, it renders with the request's `chat_template_kwargs` (listed per request in `/stats`).
`GET /stats` counts chat requests and lists each one's last message in arrival order, and the headers of every
request (`request_headers`: path and headers, lower-cased names), to check what a client sends, and the most
POSTs it answered at once (`max_in_flight`).
Binds 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


class ChatModel:
    def __init__(self, directory: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        self.model.eval()
        self.lock = threading.Lock()

    def complete(self, messages: list[dict[str, str]], max_tokens: int,
                 template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                     return_dict=True, **(template_kwargs or {}))
        eos = self.tokenizer.eos_token_id
        with self.lock, torch.no_grad():
            output = self.model.generate(**encoded, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        new = output[0, encoded["input_ids"].shape[1]:].tolist()
        stopped = eos in new
        kept = new[: new.index(eos)] if stopped else new
        text = self.tokenizer.decode(kept, skip_special_tokens=True)
        return {"content": text, "finish_reason": "stop" if stopped else "length", "tokens": len(kept) + stopped}


def make_handler(model: ChatModel, fail_first: int, fail_status: int, scripted: dict[str, dict[str, str]],
                 card: dict[str, Any]):
    state: dict[str, Any] = {"chat_requests": 0, "arrivals": [], "request_headers": [], "in_flight": 0,
                             "max_in_flight": 0, "chat_template_kwargs": []}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return None

        def send_json(self, status: int, body: dict[str, Any]) -> None:
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def note_headers(self) -> None:
            with lock:
                state["request_headers"].append(
                    {"path": self.path, "headers": {name.lower(): value for name, value in self.headers.items()}})

        def do_GET(self) -> None:
            if self.path != "/stats":
                self.note_headers()
            if self.path == "/v1/models":
                self.send_json(200, {"object": "list", "data": [card]})
            elif self.path == "/stats":
                self.send_json(200, state)
            else:
                self.send_json(404, {"error": "not found"})

        def do_POST(self) -> None:
            with lock:
                state["in_flight"] += 1
                state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            try:
                self.answer_post()
            finally:
                with lock:
                    state["in_flight"] -= 1

        def answer_post(self) -> None:
            self.note_headers()
            if self.path != "/v1/chat/completions":
                self.send_json(404, {"error": "not found"})
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                state["chat_requests"] += 1
                failing = state["chat_requests"] <= fail_first
            if failing:
                self.send_json(fail_status, {"error": {"message": "injected failure"}})
                return
            if not isinstance(body.get("messages"), list) or not body["messages"]:
                self.send_json(400, {"error": {"message": "messages must be a non-empty list"}})
                return
            last_user = body["messages"][-1].get("content", "")
            with lock:
                state["arrivals"].append(last_user)
                state["chat_template_kwargs"].append(body.get("chat_template_kwargs"))
            if last_user in scripted and "status" in scripted[last_user]:
                refusal = scripted[last_user]
                self.send_json(int(refusal["status"]), {"object": "error", "message": refusal["message"],
                                                        "type": "BadRequestError", "code": int(refusal["status"])})
                return
            if last_user in scripted:
                reply = scripted[last_user]
                time.sleep(float(reply.get("delay_s", 0.0)))
                message = {"role": "assistant", "content": reply["content"]}
                if "reasoning_content" in reply:
                    message["reasoning_content"] = reply["reasoning_content"]
                finish, tokens = "stop", len(reply["content"].split())
            else:
                generated = model.complete(body["messages"], int(body.get("max_tokens", 16)),
                                           body.get("chat_template_kwargs"))
                message = {"role": "assistant", "content": generated["content"]}
                finish, tokens = generated["finish_reason"], generated["tokens"]
            self.send_json(200, {
                "id": "chatcmpl-test", "object": "chat.completion", "model": body.get("model"),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"completion_tokens": tokens},
            })

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fail-first", type=int, default=0)
    parser.add_argument("--fail-status", type=int, default=429)
    parser.add_argument("--scripted", default=None)
    parser.add_argument("--served-model-name", default=None)
    args = parser.parse_args()
    scripted = json.loads(open(args.scripted, encoding="utf-8").read()) if args.scripted else {}
    card = {"id": args.served_model_name or args.model, "object": "model", "root": args.model}
    handler = make_handler(ChatModel(args.model), args.fail_first, args.fail_status, scripted, card)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler)
    print(f"serving on 127.0.0.1:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
