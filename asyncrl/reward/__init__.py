"""What scores a sample, in one place: rule rewards of recipes (`recipe_hooks`), reward functions
with verl's signature (`reward_function`), the table of models a run serves beside the policy
(`services`: reward models, process reward models, judges, a distillation teacher, whose
per-token logprobs are the distillation term's score) and the clients a rollout worker asks
them through, the judge's prompt and parser among them (`clients`). Their actors live with the
other model servers (asyncrl/engine/)."""
