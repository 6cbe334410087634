"""Chat completions with token-exact sessions: agents written against the OpenAI chat API train.

An agent that is a program of its own (the `openai` client, the Agents SDK, `verifiers`) runs an
episode against `POST /sessions/<id>/v1/chat/completions` on the rollout worker's gateway
(rollout/gateway.py serves the routes; asyncrl/agents/agent_process.py opens a session per
episode and starts the program). Such a client resends the whole conversation each turn, as
messages. Re-tokenizing the model's earlier turns from their text would give other tokens than
it sampled, so a session keeps the tokens instead:

  - A session holds branches: a prompt (the first request's messages rendered by the chat
    template, agent_loops/chat.py) and response segments (sampled tokens with their logprobs and
    policy versions; environment tokens with loss mask 0), with the messages they stand for (one
    canonical key per message) and a mark after each assistant turn.
  - A request whose messages extend a branch (its messages, then new ones that are not the
    assistant's) continues it: the new messages are appended as the tokens the template renders
    for them (`ChatFormat.append_ids`), never re-rendering what is there.
  - A request that disagrees with every branch (the agent edited, dropped or summarized earlier
    messages, or sent one conversation twice) branches: it shares the tokens of the branch it
    agrees with longest, up to the end of the last assistant turn they share, and renders the rest
    of its messages after them (loss mask 0). The shared tokens are the earlier branch's as
    sampled; in the new branch they are context (loss mask 0), so each sampled token is trained
    once. A request that agrees with no assistant turn of any branch starts a new root (its whole
    conversation rendered as the prompt).
  - The session samples at its sampling settings (a training run's rollout temperature and top_p:
    a request may repeat them, not change them) and at most `max_new_tokens` tokens over all its
    turns and branches (rollout.max_new_tokens bounds an episode as it bounds an agent loop).
  - Requests of one session run one at a time (a lock): a second request sent before the first
    was answered sees the history without that answer, and branches.

Each branch becomes a trajectory when the session closes (`SessionRecord`); generation goes through
the gateway (`agenerate`), so a weight sync mid-turn is carried as it is for every request and
each token keeps its policy version. What the endpoint does not honour is refused with a 400 that
names the field (`ChatRefusal`); nothing that changes sampling is ignored.

Cost per turn: the prefix check compares one key per message (O(messages)); the template renders
only the new messages; a branch copies its shared tokens once (O(tokens)).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from agent_loops.chat import ChatFormat, ChatTemplateError, chat_format
from agent_loops.tool_parsers import ToolCall, get_tool_parser
from asyncrl.agents.http_guard import scoped_key
from asyncrl.inference.protocol import ChatSessionHost, Endpoint, SessionRecord, SessionTicket
from asyncrl.types import GenerationResult, RoutedExperts, SamplingSpec, Segment, Trajectory, TrajectoryStatus

logger = logging.getLogger(__name__)

MAX_BRANCHES = 256  # of one session: each holds its tokens; an agent that forks every turn is refused past it
MAX_STOP_STRINGS = 16

# -- the request: the subset of OpenAI's chat completions that agent libraries send ----------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class _Function(_Strict):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class _ToolCall(_Strict):
    id: StrictStr
    type: Literal["function"] = "function"
    function: _Function


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[_TextPart] | None = None
    name: StrictStr | None = None  # a tool message's is its call's; the others' is not rendered
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    # What the openai SDK's `message.model_dump()` carries back: accepted empty only.
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: list[Any] | None = Field(None, max_length=0)


class _FunctionSchema(BaseModel):
    model_config = ConfigDict(extra="allow")  # strict, descriptions: the template renders what it renders
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class ToolSchema(_Strict):
    type: Literal["function"]
    function: _FunctionSchema


class ChatBody(_Strict):
    """A chat completions request. Fields past these are refused by name (extra="forbid"); the
    ones below that would change sampling are refused unless at their neutral value."""

    messages: list[ChatMessage] = Field(min_length=1)
    model: StrictStr = ""
    tools: list[ToolSchema] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    temperature: StrictFloat | StrictInt | None = Field(None, ge=0)
    top_p: StrictFloat | StrictInt | None = Field(None, gt=0, le=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = Field(1, ge=1, le=1)  # one choice a turn: an episode that wants more opens more sessions
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=0)
    stream: StrictBool = False
    stream_options: dict[str, StrictBool] | None = None  # {"include_usage": true}
    parallel_tool_calls: Literal[True] | None = None  # the model may write several calls a turn; False is refused
    frequency_penalty: Literal[0] | None = None
    presence_penalty: Literal[0] | None = None
    # Bookkeeping the client sends that changes nothing here
    user: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None


class ChatRefusal(Exception):
    """A request the endpoint answers with an error: `status`, a stable `code` it is counted by, the
    `param` (field) it names and a message for people."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    def body(self) -> dict[str, Any]:
        """OpenAI's error shape (the SDKs raise it as BadRequestError & co. with this message)."""
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}


def parse_body(raw: Any) -> ChatBody:
    """The request, or a 400 naming every field that is wrong (an unknown field by its name)."""
    try:
        return ChatBody.model_validate(raw)
    except ValidationError as e:
        problems = [f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()[:5]]
        first = ".".join(str(x) for x in e.errors()[0]["loc"])
        raise ChatRefusal(400, "bad_request", "; ".join(problems), first) from None


# -- messages as the template renders them, and their keys ------------------------------------

@dataclass(frozen=True)
class Conversation:
    """A request's messages as the chat template takes them, one canonical key per message
    (what a session compares), and the tools offered."""

    messages: list[dict[str, Any]]
    keys: list[str]
    tools: list[dict[str, Any]]
    tools_key: str


def _text(content: str | list[_TextPart] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part.text for part in content)


def conversation(body: ChatBody) -> Conversation:
    """The request's conversation; a 400 naming the message that cannot be rendered as sent."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    names = {t["function"]["name"] for t in tools}
    messages: list[dict[str, Any]] = []
    open_calls: dict[str, str] = {}  # the last assistant turn's calls by id: what tool messages answer
    for i, m in enumerate(body.messages):
        where = f"messages.{i}"
        if m.role != "assistant" and m.tool_calls:
            raise ChatRefusal(400, "bad_request", f"{where}.tool_calls: only an assistant message makes calls",
                              f"{where}.tool_calls")
        if m.role == "tool":
            if m.tool_call_id not in open_calls:
                raise ChatRefusal(400, "bad_request", f"{where}.tool_call_id {m.tool_call_id!r} answers no call of "
                                  "the last assistant message", f"{where}.tool_call_id")
            messages.append({"role": "tool", "name": open_calls[m.tool_call_id], "content": _text(m.content)})
            continue
        if m.tool_call_id is not None:
            raise ChatRefusal(400, "bad_request", f"{where}.tool_call_id: only a tool message has one",
                              f"{where}.tool_call_id")
        if m.role != "assistant":
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)})
            continue
        calls, open_calls = [], {}
        for j, call in enumerate(m.tool_calls or []):
            at = f"{where}.tool_calls.{j}.function"
            if call.function.name not in names:
                raise ChatRefusal(400, "unknown_tool", f"{at}.name {call.function.name!r} is not a tool of this "
                                  f"request (tools: {', '.join(sorted(names)) or 'none'})", f"{at}.name")
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise ChatRefusal(400, "bad_request", f"{at}.arguments: not a JSON object", f"{at}.arguments")
            calls.append((call.function.name, arguments))
            open_calls[call.id] = call.function.name
        messages.append(_assistant(_text(m.content), calls))
    if body.messages[-1].role == "assistant":
        raise ChatRefusal(400, "bad_request", "messages: the last message is the assistant's: there is nothing to "
                          "answer (continuing an assistant message is not supported)", "messages")
    return Conversation(messages, [_key(m) for m in messages], tools, json.dumps(tools, sort_keys=True))


def _assistant(content: str, calls: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """An assistant message as the template renders it (and as sessions compare it): its text and
    its calls by name and parsed arguments (ids and the SDKs' empty fields left out)."""
    rendered = [{"type": "function", "function": {"name": name, "arguments": arguments}} for name, arguments in calls]
    return {"role": "assistant", "content": content, **({"tool_calls": rendered} if rendered else {})}


def _key(message: dict[str, Any]) -> str:
    """What a session compares a message by: its rendering form, canonical."""
    return json.dumps(message, sort_keys=True, ensure_ascii=False)


# -- sessions ------------------------------------------------------------------------------

@dataclass
class _Branch:
    """One line of a session's conversation, as tokens (see the module docstring)."""

    prompt_ids: list[int]
    tools_key: str
    keys: list[str]  # the messages the tokens stand for
    segments: list[Segment] = field(default_factory=list)
    # After each assistant turn: (messages covered, response tokens so far)
    marks: list[tuple[int, int]] = field(default_factory=list)
    routes: RoutedExperts | None = None
    turns: int = 0
    tool_calls: int = 0  # calls answered to the agent (it runs them)
    truncated: bool = False  # its last turn hit its token budget or the context

    def response(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]


@dataclass
class ChatSession:
    session_id: str
    sampling: SamplingSpec
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    branches: list[_Branch] = field(default_factory=list)
    last: _Branch | None = None  # the branch of the latest turn
    reward: float | None = None
    reward_posted: asyncio.Event = field(default_factory=asyncio.Event)
    refused: dict[str, int] = field(default_factory=dict)
    sampled: int = 0  # tokens sampled over all its turns and branches: `sampling.max_new_tokens` bounds it


@dataclass(frozen=True)
class ChatSettings:
    """What the chat endpoint reads of the run: the tool parser that reads calls from a turn
    (tools.parser), the context (engine.max_model_len), the bound on a posted reward
    (reward.max_abs) and the model name answered."""

    tool_parser: str
    max_model_len: int
    max_abs_reward: float
    model_name: str = "asyncrl"


@dataclass
class _Plan:
    """Where a turn's tokens go: continue `branch` in place, or a new branch (not yet in the
    session) that becomes one once its turn is answered."""

    branch: _Branch
    new: bool
    messages: list[dict[str, Any]]  # the conversation's messages past the branch's
    env_ids: list[int]  # their tokens, up to the next turn's generation prompt


class ChatSessions(ChatSessionHost):
    """The chat endpoint's sessions, on one gateway. `generate`: the gateway's `agenerate` (carries
    weight syncs); `serve`: starts the gateway's HTTP server (once) and gives its endpoint;
    `secret`: the gateway's key, which session keys derive from; `count`: counts a failure by code."""

    def __init__(self, generate: Callable[[list[int], SamplingSpec, str], Awaitable[GenerationResult]],
                 tokenizer: Any, settings: ChatSettings, serve: Callable[[], Awaitable[Endpoint]], secret: str,
                 count: Callable[[str, str], None] | None = None):
        self.generate, self.tokenizer, self.settings = generate, tokenizer, settings
        self._serve, self._secret, self._count = serve, secret, count
        self.sessions: dict[str, ChatSession] = {}
        self._chat: ChatFormat | None = None
        # Turns answered and the seconds spent on them outside generation (checks, prefix, rendering,
        # parsing the answer): the endpoint's own cost (`asyncrl bench chat`)
        self.turns, self.overhead_s = 0, 0.0

    def chat(self) -> ChatFormat:
        """The tokenizer's chat template, checked token-exact (on first use: a run of plain prompts
        never needs one)."""
        if self._chat is None:
            try:
                self._chat = chat_format(self.tokenizer)
            except ChatTemplateError as e:
                raise ChatRefusal(500, "bad_chat_template", f"this run's model cannot serve chat: {e}") from None
        return self._chat

    # -- ChatSessionHost -----------------------------------------------------------------

    async def open_session(self, sampling: SamplingSpec) -> SessionTicket:
        endpoint = await self._serve()
        sid = secrets.token_urlsafe(16)
        self.sessions[sid] = ChatSession(sid, sampling)
        root = endpoint.base_url.removesuffix("/v1")
        return SessionTicket(sid, f"{root}/sessions/{sid}/v1", scoped_key(self._secret, sid),
                             f"{root}/sessions/{sid}/reward", self.settings.model_name)

    async def rewarded(self, session_id: str) -> float:
        session = self.sessions[session_id]
        await session.reward_posted.wait()
        assert session.reward is not None
        return session.reward

    def close_session(self, session_id: str) -> SessionRecord:
        session = self.sessions.pop(session_id)
        ordered = [b for b in session.branches if b is not session.last] + ([session.last] if session.last else [])
        branches = [Trajectory("", "", list(b.prompt_ids), segments=list(b.segments), routes=b.routes,
                               status=TrajectoryStatus.TRUNCATED if b.truncated else TrajectoryStatus.OK,
                               info={"turns": b.turns, "tool_calls": b.tool_calls}) for b in ordered]
        return SessionRecord(branches, session.reward, sum(b.turns for b in session.branches), dict(session.refused))

    def count(self, code: str, detail: str = "") -> None:
        if self._count is not None:
            self._count(code, detail)

    # -- the HTTP side (rollout/gateway.py's routes) --------------------------------------

    def refused(self, session_id: str | None, refusal: ChatRefusal) -> None:
        """Count a refused request (in its session's record too)."""
        session = self.sessions.get(session_id or "")
        if session is not None:
            session.refused[refusal.code] = session.refused.get(refusal.code, 0) + 1
        self.count(f"chat_{refusal.code}", refusal.message)

    def post_reward(self, session_id: str, raw: Any) -> None:
        """`{"reward": <finite number within reward.max_abs>}`, once per session."""
        session = self._session(session_id)
        reward = raw.get("reward") if isinstance(raw, dict) and set(raw) == {"reward"} else None
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise ChatRefusal(400, "bad_reward", 'the body must be {"reward": <number>}', "reward")
        bound = self.settings.max_abs_reward
        if not math.isfinite(reward) or abs(reward) > bound:
            raise ChatRefusal(400, "bad_reward", f"reward {reward!r}: must be a finite number within "
                              f"[-{bound:g}, {bound:g}] (reward.max_abs)", "reward")
        if session.reward_posted.is_set():
            raise ChatRefusal(409, "reward_twice", "this session's reward was posted already", "reward")
        session.reward = float(reward)
        session.reward_posted.set()

    def _session(self, session_id: str) -> ChatSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise ChatRefusal(404, "unknown_session", "no such session, or it has ended")
        return session

    async def complete(self, session_id: str | None, body: ChatBody) -> dict[str, Any]:
        """One turn: the answer as OpenAI's chat completion (plus asyncrl's `token_ids` and
        `versions` in the choice). `session_id` None: a turn of no session (nothing recorded;
        the request's temperature and top_p are honoured)."""
        t0 = time.perf_counter()
        conv = conversation(body)
        if session_id is None:
            s = self.settings
            sampling = SamplingSpec(max_new_tokens=s.max_model_len,
                                    temperature=1.0 if body.temperature is None else float(body.temperature),
                                    top_p=1.0 if body.top_p is None else float(body.top_p))
            session = ChatSession("", sampling)
        else:
            session = self._session(session_id)
            self._check_sampling(body, session.sampling)
        async with session.lock:
            plan = self._plan(session, conv)
            return await self._turn(session, plan, conv, body, t0)

    @staticmethod
    def _check_sampling(body: ChatBody, sampling: SamplingSpec) -> None:
        """A session samples as the run does: a request may repeat its temperature and top_p, not change them."""
        for name, asked, run in (("temperature", body.temperature, sampling.temperature),
                                 ("top_p", body.top_p, sampling.top_p)):
            if asked is not None and not math.isclose(asked, run):
                raise ChatRefusal(400, "bad_request", f"{name}={asked:g}: this session samples at {name}={run:g} "
                                  "(the run's rollout settings; an evaluation's own); leave it out or send that",
                                  name)

    def _plan(self, session: ChatSession, conv: Conversation) -> _Plan:
        """Continue the branch the conversation extends, or fork the one it agrees with longest at
        the end of their last shared assistant turn, or start a new root (module docstring)."""
        best: tuple[int, int, _Branch, int] | None = None  # (messages shared, in place?, branch, response tokens)
        for branch in session.branches:
            if branch.tools_key != conv.tools_key:
                continue
            shared = _common_prefix(branch.keys, conv.keys)
            if shared == len(branch.keys) and branch.marks:
                candidate = (shared, 1, branch, branch.marks[-1][1])
            else:
                at = [m for m in branch.marks if m[0] <= shared]
                if not at:
                    continue
                candidate = (at[-1][0], 0, branch, at[-1][1])
            if best is None or candidate[:2] > best[:2]:
                best = candidate
        chat = self.chat()
        if best is None:  # a new root: the whole conversation is its prompt
            root = _Branch(chat.prompt(conv.messages, conv.tools), conv.tools_key, list(conv.keys))
            return _Plan(root, True, [], [])
        covered, in_place, branch, tokens = best
        if not in_place:
            branch = _fork(branch, covered, tokens)
        response = branch.response()
        added = conv.messages[covered:]
        env_ids = chat.append_ids(added, response[-len(chat.end_of_turn.closing):])
        return _Plan(branch, not in_place, added, env_ids)

    async def _turn(self, session: ChatSession, plan: _Plan, conv: Conversation, body: ChatBody,
                    t0: float) -> dict[str, Any]:
        branch, chat = plan.branch, self.chat()
        if plan.new and session.session_id and len(session.branches) >= MAX_BRANCHES:
            raise ChatRefusal(400, "too_many_branches", f"this session has {MAX_BRANCHES} branches (the agent "
                              "rewrote its history that often); no more are opened", "messages")
        ids = branch.prompt_ids + branch.response() + plan.env_ids
        context_left = self.settings.max_model_len - len(ids)
        if context_left <= 0:
            raise ChatRefusal(400, "prompt_too_long", f"the conversation is {len(ids)} tokens: engine.max_model_len="
                              f"{self.settings.max_model_len} leaves no room to answer", "messages")
        budget_left = session.sampling.max_new_tokens - session.sampled
        if budget_left <= 0:
            raise ChatRefusal(400, "budget_spent", f"this episode sampled its {session.sampling.max_new_tokens} "
                              "tokens (rollout.max_new_tokens): it cannot generate more", "max_tokens")
        asked = body.max_completion_tokens or body.max_tokens
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise ChatRefusal(400, "bad_request", f"stop: at most {MAX_STOP_STRINGS} strings", "stop")
        calls_on = bool(conv.tools) and body.tool_choice != "none"
        parser = get_tool_parser(self.settings.tool_parser)
        sampling = SamplingSpec(
            max_new_tokens=min(context_left, budget_left, asked or budget_left),
            temperature=session.sampling.temperature, top_p=session.sampling.top_p,
            stop=[*stop, *chat.end_of_turn.stop, *(parser.stop if calls_on else ())],
            stop_token_ids=list(chat.end_of_turn.stop_token_ids))
        rid = f"chat-{session.session_id or 'none'}-{secrets.token_hex(4)}"
        t1 = time.perf_counter()
        result = await self.generate(ids, sampling, rid)
        t2 = time.perf_counter()
        message, finish, answer_key = self._message(result, stop, calls_on, {t["function"]["name"] for t in conv.tools})
        if session.session_id:  # commit: the branch takes the turn's tokens and the messages they stand for
            if plan.env_ids:
                branch.segments.append(Segment.from_env(plan.env_ids))
            branch.segments.append(Segment.from_policy(result.token_ids, result.logprobs, result.versions))
            branch.keys = list(conv.keys) + [answer_key]
            branch.marks.append((len(branch.keys), len(branch.response())))
            branch.turns += 1
            branch.tool_calls += len(message.get("tool_calls") or [])
            branch.truncated = finish == "length"
            if result.routes is not None:
                branch.routes = result.routes if branch.routes is None else branch.routes.extended(result.routes)
            if plan.new:
                session.branches.append(branch)
            session.last = branch
            session.sampled += len(result.token_ids)
        self.turns += 1
        self.overhead_s += (t1 - t0) + (time.perf_counter() - t2)
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish,
                                  "logprobs": self._logprobs(result) if body.logprobs else None,
                                  "token_ids": result.token_ids, "versions": result.versions}
        return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
                "model": self.settings.model_name, "choices": [choice],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(result.token_ids),
                          "total_tokens": len(ids) + len(result.token_ids)}}

    def _message(self, result: GenerationResult, stop: list[str], calls_on: bool,
                 tools: set[str]) -> tuple[dict[str, Any], str, str]:
        """The assistant message of a turn's tokens, its finish reason, and its key as the client will
        send it back (`conversation`'s normalization). Calls are read with the
        run's tool parser; a turn with a malformed call, or one to a tool not offered, is answered
        as its text (the agent sees what the model wrote; the history could not name that tool)."""
        chat = self.chat()
        eot = set(chat.end_of_turn.stop_token_ids)
        text = self.tokenizer.decode([t for t in result.token_ids if t not in eot])  # calls may be special tokens
        for marker in chat.end_of_turn.stop:
            text = text.removesuffix(marker)
        finish = "length" if result.finish_reason == "length" else "stop"
        for s in stop:  # OpenAI leaves a stop string out of the answer (the tokens keep it)
            if finish == "stop" and s and text.endswith(s):
                text = text[: -len(s)]
                break
        parser = get_tool_parser(self.settings.tool_parser)
        calls: list[ToolCall] = parser.parse(text) if calls_on else []
        if calls and all(not c.error and c.name in tools and isinstance(c.arguments, dict) for c in calls):
            opening = text.find(parser.opening)
            content = text[:opening].strip() if opening >= 0 else ""
            message = {"role": "assistant", "content": content or None, "tool_calls": [
                {"id": f"call_{secrets.token_hex(8)}", "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                for c in calls]}
            key = _key(_assistant(content, [(c.name, c.arguments) for c in calls]))
            return message, "tool_calls" if finish == "stop" else finish, key
        return {"role": "assistant", "content": text}, finish, _key(_assistant(text, []))

    def _logprobs(self, result: GenerationResult) -> dict[str, Any]:
        out = []
        for token, logprob in zip(result.token_ids, result.logprobs):
            text = self.tokenizer.decode([token])
            out.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
        return {"content": out}


def _common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _fork(branch: _Branch, covered: int, tokens: int) -> _Branch:
    """A new branch sharing `branch`'s first `tokens` response tokens (its first `covered`
    messages) as context: their loss mask 0, so that only `branch` trains them."""
    response = branch.response()[:tokens]
    routes = branch.routes.prefix(len(branch.prompt_ids) + tokens) if branch.routes is not None else None
    return _Branch(list(branch.prompt_ids), branch.tools_key, branch.keys[:covered],
                   [Segment.from_env(response)] if response else [], [m for m in branch.marks if m[0] <= covered],
                   routes)

