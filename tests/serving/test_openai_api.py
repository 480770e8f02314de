"""The OpenAI protocol without HTTP: stop strings cut the text exactly where they begin, even
across tokens; chat templates render as Hugging Face renders them; a checkpoint's template
survives saving and loading; and a body becomes the engine request it says."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minillm
from minillm.core.tokenizer import TextStream
from minillm.serving.openai_api import APIError, ModelInfo, parse_job, render_chat
from tests.serving.conftest import CHAT_TEMPLATE


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return minillm.load(checkpoint)[1]


@pytest.fixture(scope="module")
def info(tokenizer) -> ModelInfo:
    return ModelInfo("tiny-serve", tokenizer, tokenizer.vocab_size, 64, (0,))


def stream_text(tokenizer, text: str, stop: tuple[str, ...]) -> tuple[list[str], TextStream]:
    s = TextStream(tokenizer, stop)
    pieces = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        pieces.append(s.push(token))
        if s.stopped:
            break
    pieces.append(s.finish())
    return pieces, s


@pytest.mark.parametrize(
    "stop, expected",
    [
        ((), "def add(a, b):\n    return a + b\n"),
        (("return",), "def add(a, b):\n    "),
        (("(a", "b):"), "def add"),  # the earliest of several
        (("a + b\n",), "def add(a, b):\n    return "),
        (("nowhere",), "def add(a, b):\n    return a + b\n"),
    ],
)
def test_stop_strings_cut_the_text_where_they_begin(tokenizer, stop, expected):
    pieces, s = stream_text(tokenizer, "def add(a, b):\n    return a + b\n", stop)
    assert "".join(pieces) == expected
    assert s.stopped == (expected != "def add(a, b):\n    return a + b\n")


@pytest.mark.parametrize(
    "text, stop, released",
    [
        ("abc ST", ("STOP",), "abc "),  # "ST" may be the start of "STOP": held back
        ("abc d", ("STOP",), "abc d"),  # nothing here begins "STOP": nothing waits
        ("abc x", ("STOP", "xyz"), "abc "),
        ("abc SX", ("STOP", "Xa"), "abc S"),
    ],
)
def test_only_text_that_may_start_a_stop_string_is_held_back(tokenizer, text, stop, released):
    s = TextStream(tokenizer, stop)
    out = "".join(s.push(t) for t in tokenizer.encode(text, add_special_tokens=False))
    assert out == released
    assert out + s.finish() == text


@settings(max_examples=150, deadline=None)
@given(
    text=st.text("ab c\n", max_size=30), stop=st.lists(st.text("ab c", min_size=1, max_size=4), min_size=1, max_size=3)
)
def test_a_stop_string_never_leaks_and_nothing_else_waits(tokenizer, text, stop):
    """What comes out is the text up to the first stop string, never a character of it or after
    it; and while streaming, the only text held back is a beginning of a stop string."""
    s, ids, out = TextStream(tokenizer, tuple(stop)), tokenizer.encode(text, add_special_tokens=False), ""
    for k, token in enumerate(ids):
        out += s.push(token)
        if s.stopped:
            break
        held = tokenizer.decode(ids[: k + 1])[len(out) :]
        assert any(x.startswith(held) for x in stop), f"{held!r} waits but begins no stop string"
    out += s.finish()
    assert text.startswith(out) and not any(x in out for x in stop)
    assert any(text[len(out) :].startswith(x) for x in stop) if s.stopped else out == text


def test_the_chat_template_is_saved_loaded_and_rendered(tokenizer):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = render_chat(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert text == "<|endoftext|><|system|>Be brief.\n<|user|>hi\n<|assistant|>"


def test_a_body_becomes_the_request_it_says(info, tokenizer):
    body = {"prompt": "def add", "max_tokens": 5, "temperature": 0.5, "top_k": 3, "seed": 7, "stop": "x"}
    job = parse_job(body, info, chat=False)
    r = job.request
    assert r.prompt == tokenizer.encode("def add") and r.max_tokens == 5 and r.stop_ids == (0,)
    assert (r.params.temperature, r.params.top_k, r.params.top_p, r.params.seed) == (0.5, 3, None, 7)
    assert job.stop == ("x",) and not job.stream and not job.chat
    ids = parse_job({"prompt": [[3, 4, 5]], "ignore_eos": True}, info, chat=False).request
    assert ids.prompt == [3, 4, 5] and ids.max_tokens == 16 and ids.stop_ids == ()  # OpenAI's default length
    chat = parse_job({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, info, True)
    assert chat.request.max_tokens == 64 - len(chat.request.prompt)  # the rest of the context
    assert chat.id.startswith("chatcmpl-")
    small_pool = ModelInfo("tiny-serve", tokenizer, tokenizer.vocab_size, 64, (0,), kv_pool_tokens=40)
    chat = parse_job({"messages": [{"role": "user", "content": "hi"}]}, small_pool, True)
    assert chat.request.max_tokens == 40 - len(chat.request.prompt)  # what the KV pool can hold


def test_a_checkpoint_without_a_chat_template_says_so(info):
    bare = ModelInfo("bare", minillm.Tokenizer(info.tokenizer._tok), info.vocab_size, 64, ())
    with pytest.raises(APIError, match="has no chat template") as e:
        parse_job({"messages": [{"role": "user", "content": "hi"}]}, bare, chat=True)
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages", "no_chat_template")


def test_a_template_error_is_a_400_on_messages(info, tokenizer):
    strict = minillm.Tokenizer(tokenizer._tok, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(APIError, match="roles must alternate") as e:
        parse_job({"messages": [{"role": "user", "content": "hi"}]}, ModelInfo("s", strict, 300, 64, ()), chat=True)
    assert e.value.param == "messages"


@pytest.mark.parametrize(
    "content",
    [5, None, [{"type": "text", "text": 5}], ["hi"], [{"type": "text"}], [{"type": "image_url", "image_url": {}}]],
)
def test_a_bad_content_part_is_a_400_on_that_message(info, content):
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]}
    with pytest.raises(APIError, match="must be a string or a list of text parts") as e:
        parse_job(body, info, chat=True)
    assert (e.value.status, e.value.param) == (400, "messages[1].content")


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_a_prompt_larger_than_the_kv_pool_names_the_prompt_not_max_tokens(tokenizer, chat):
    """The client sent no max_tokens: the error must name what it did send."""
    small_pool = ModelInfo("tiny-serve", tokenizer, tokenizer.vocab_size, 512, (0,), kv_pool_tokens=20)
    text = "def add(a, b): return a + b " * 4
    body = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    with pytest.raises(APIError, match="the KV pool holds 20 tokens") as e:
        parse_job(body, small_pool, chat)
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages" if chat else "prompt", "request_too_large")


def test_token_bytes_spell_each_token_and_join_to_the_text():
    """A byte-level token may be part of a character: its bytes, joined with the others', are the
    text; a token that is whole characters is its text, and a text prompt's length bounds its tokens."""
    _, tokenizer = minillm.load("minillm-draft")
    text = "héllo wörld — ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode() == text
    assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces), "the accents should split into byte tokens"
    assert tokenizer.token_bytes(tokenizer.eos_id) == b"<|endoftext|>"
    assert len(text) <= len(ids) * tokenizer.max_token_chars
