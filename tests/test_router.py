from asyncrl.rollout.router import EngineRouter


def test_picks_the_engine_with_fewest_outstanding_requests():
    router = EngineRouter(["e0", "e1", "e2"])
    router.outstanding = [3, 1, 2]
    assert router.pick() == 1
    router.outstanding = [0, 5, 0]
    assert router.pick() == 0  # tie on outstanding: the one assigned least so far
    assert router.pick() == 2
    assert router.assigned == [1, 1, 1]


def test_each_new_trajectory_is_routed_afresh():
    router = EngineRouter(["e0", "e1"])
    first, second = router.client(), router.client()
    assert (first.index, second.index) == (0, 1)
    router.outstanding = [9, 0]  # engine 0 is busy now: a new trajectory goes to engine 1
    assert router.client().index == 1
