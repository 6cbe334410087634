"""How agent loops, agents and rollout workers reach an engine: the inference protocol
(`protocol.py`: token in, token out, with logprobs and policy versions) and the engine's
request channel (`channel.py`: msgpack frames over TCP, one connection per worker).
Engines serve it; rollout workers, agents and agent loops use it; nothing here knows vLLM."""
