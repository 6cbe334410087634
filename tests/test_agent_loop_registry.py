import pytest

from agent_loops.registry import _LOOPS, get_agent_loop, register_agent_loop, registered_agent_loops


@pytest.fixture(autouse=True)
def clean_registry():
    saved = dict(_LOOPS)
    yield
    _LOOPS.clear()
    _LOOPS.update(saved)


def test_register_and_look_up_by_name():
    @register_agent_loop("echo_test")
    class Echo:
        pass

    assert get_agent_loop("echo_test") is Echo
    assert "echo_test" in registered_agent_loops()


def test_a_name_cannot_be_taken_twice():
    @register_agent_loop("dup_test")
    class A:
        pass

    with pytest.raises(ValueError, match="already registered"):
        @register_agent_loop("dup_test")
        class B:
            pass


def test_unknown_name_lists_the_registered_loops():
    @register_agent_loop("known_test")
    class Known:
        pass

    with pytest.raises(KeyError, match="unknown agent loop 'nope'; registered loops: .*known_test"):
        get_agent_loop("nope")
