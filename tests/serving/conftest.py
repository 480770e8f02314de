"""What the server tests share: a tiny checkpoint with a tokenizer and a chat template, and a
live server (uvicorn in a thread of this process, on a free port of 127.0.0.1)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import minillm
from minillm.serving.async_engine import AsyncEngine
from minillm.serving.engine import Engine, EngineConfig
from minillm.serving.scheduler import SchedulerConfig
from tests.conftest import tiny_model
from tests.test_cli import tiny_tokenizer

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tiny_checkpoint(directory: Path) -> Path:
    """A tiny random model (no EOS: answers run to max_tokens) with a byte-level tokenizer and a
    chat template, saved in Hugging Face layout."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model = tiny_model(vocab_size=tokenizer.vocab_size, max_seq_len=512, bos_token_id=0)
    return minillm.save_pretrained(model, directory / "tiny-serve", tokenizer)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("serve"))


def make_engine(model, num_blocks: int = 128, block_size: int = 16, max_batch: int = 16) -> AsyncEngine:
    return AsyncEngine(
        Engine(model, EngineConfig(num_blocks, block_size, scheduler=SchedulerConfig(max_batch=max_batch)))
    )


class LiveServer:
    """``with LiveServer(app) as url:`` serves ``app`` until the block ends (bounded start and stop)."""

    def __init__(self, app, engine: AsyncEngine, shutdown_timeout: float = 1.0):
        from minillm.serving.http import bind, make_server

        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = make_server(app, shutdown_timeout, drain=lambda: engine.shutdown(timeout=0))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive(), "the server did not stop"
