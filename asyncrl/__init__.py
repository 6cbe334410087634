"""asyncrl: fully asynchronous RL post-training for LLMs on Ray, vLLM and megatron-core.

Layout (see README.md and DESIGN.md): `types` (data crossing actors), `config`
(schema, composition, validation), `tasks` (offline reasoning-gym problems),
`engine` (vLLM), then the actors, and at the top the driver and the CLI.
"""

__version__ = "0.1.0"
