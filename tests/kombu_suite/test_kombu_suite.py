"""kombu's own integration suite (``t/integration/common.py`` of the installed kombu, from its
sdist, unmodified) against pgbroker, subclassed as kombu's ``test_py_amqp.py`` does."""

from __future__ import annotations

import pytest

from tests.kombu_suite import sdist

try:
    common = sdist.load_common()
except RuntimeError as exc:  # no network: say so rather than pass
    pytest.skip(f"kombu's integration suite is not available: {exc}", allow_module_level=True)


class TestBasicFunctionality(common.BasicFunctionality):
    pass


class TestExchangeTypes(common.BaseExchangeTypes):
    pass


class TestTimeToLive(common.BaseTimeToLive):
    pass


class TestPriority(common.BasePriority):
    PRIORITY_ORDER = "asc"  # AMQP's direction: higher runs first


class TestFailover(common.BaseFailover):
    pass


class TestMessage(common.BaseMessage):
    pass


if hasattr(common, "BaseEventLoop"):  # kombu's suite has event loop tests from 5.7 on
    class TestEventLoop(common.BaseEventLoop):
        pass
