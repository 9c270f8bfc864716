"""Every API's reply format satisfies the Protocol app.py drives (serving/reply_format.py):
the methods exist and take the parameters the Protocol names, and the optional hooks
app.py checks for are found exactly on the formats that have them."""

import inspect

import pytest

from monolith.serving.anthropic.reply import MessagesFormat
from monolith.serving.reply_format import Cancellable, ReplyFormat, Resumable, StreamFormat
from monolith.serving.openai.reply import ChatFormat, CompletionFormat
from monolith.serving.responses.compact import CompactFormat
from monolith.serving.responses.reply import ResponseFormat

STREAMED = (ChatFormat, CompletionFormat, MessagesFormat, ResponseFormat)
PROTOCOLS = (ReplyFormat, StreamFormat, Resumable, Cancellable)


def _methods(protocol) -> dict:
    names = [n for n in dir(protocol) if not n.startswith("_") and callable(getattr(protocol, n))]
    return {n: list(inspect.signature(getattr(protocol, n)).parameters) for n in names}


def _satisfies(cls, protocol) -> bool:
    """Every method the Protocol names, with its parameters (by name, in order)."""
    wanted = _methods(protocol)
    return all(hasattr(cls, n) and list(inspect.signature(getattr(cls, n)).parameters) == params
               for n, params in wanted.items())


@pytest.mark.parametrize("cls", STREAMED + (CompactFormat,), ids=lambda c: c.__name__)
def test_formats_satisfy_the_protocol(cls):
    for protocol in PROTOCOLS:  # the structural check app.py makes agrees with the signatures
        assert issubclass(cls, protocol) == _satisfies(cls, protocol), protocol.__name__
    assert issubclass(cls, ReplyFormat)
    assert issubclass(cls, StreamFormat) == (cls in STREAMED)  # compaction is never streamed


def test_the_hooks_are_where_the_formats_have_them():
    assert [c.__name__ for c in STREAMED if issubclass(c, Resumable)] == ["MessagesFormat"]
    assert [c.__name__ for c in STREAMED + (CompactFormat,) if issubclass(c, Cancellable)] == ["ResponseFormat"]
    assert len(_methods(StreamFormat)) == 9  # the nine methods app.py calls on a streamed reply
