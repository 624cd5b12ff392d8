"""``ToolEnvironment`` (env name ``tools``): the model calls tools, the environment runs them and answers.

Each model turn is parsed for ``<tool_call>`` blocks (streamrft.envs.tools). A turn without one ends
the episode (``done``; the final reward comes from the reward sources). Otherwise every call is run in
order and answered as a ``role: tool`` observation: a tool's output, or ``error (REASON): message``.
Nothing a call does raises out of ``step``: a malformed call, an unknown tool, bad arguments, a sandbox
limit, all are observations the model sees, counted in ``info``:

    tool_calls          <tool_call> blocks in the turn (malformed ones included)
    tool_errors         calls that ended in an error
    tool_error_reason   the first error's reason ("" when none): tool_parse, unknown_tool, bad_arguments,
                        too_many_calls, calculator_error, or a sandbox reason (timeout, cpu_limit,
                        memory_limit, process_limit, file_limit, network_blocked, fs_escape, error)
    tool_error_reasons  every error's reason, in call order
    tool_seconds        wall time spent running the calls
    messages            one tool message per call ({"role": "tool", "name", "content"})

The observation text is the calls' results joined by blank lines (one tool message when a renderer
shows a single observation); ``info["messages"]`` keeps them apart for renderers that append one
message per call (streamrft.envs.tools.append_messages).

Tools (``env.kwargs.tools``, default both):

``python``      ``{"code": str}`` runs on the sandbox (streamrft.envs.sandbox); the answer is stdout, then
                stderr; limits from ``env.kwargs.limits`` (SandboxLimits keys).
``calculator``  ``{"expression": str}``: integers with + - * / // % ** and parentheses, evaluated exactly
                over the AST (never eval): ``/`` is exact (an integer when it divides, else a decimal of 12
                significant digits); operands and results are capped at ``calculator_max_digits`` digits,
                an exponent's result is checked before it is computed.
"""

from __future__ import annotations

import ast
import asyncio
import threading
import time
from fractions import Fraction

from streamrft.envs.base import EnvStep, register_environment
from streamrft.envs.sandbox import SandboxLimits, run_python
from streamrft.envs.tools import ToolCall, ToolCallError, parse_tool_calls, tool_message

TOOL_NAMES = ("python", "calculator")
# Function schemas for the prompt's tools= rendering (the chat template lists them in the system turn).
TOOL_SCHEMAS = {
    "python": {"type": "function", "function": {
        "name": "python", "description": "Run Python code in a sandbox and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
    "calculator": {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an integer arithmetic expression exactly (+ - * / // % **).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
}
_ARGUMENTS = {"python": "code", "calculator": "expression"}


class ToolError(Exception):
    """A call that ends as an error observation; ``reason`` is what the counters say."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# --- calculator ------------------------------------------------------------------------------------------

_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}


def calculate(expression: str, max_digits: int = 1000, max_length: int = 2000) -> str:
    """The exact value of an integer expression as text; ToolError("calculator_error", why) otherwise."""
    if not isinstance(expression, str):
        raise ToolError("bad_arguments", f"calculator: 'expression' must be a string, got {type(expression).__name__}")
    if len(expression) > max_length:
        raise ToolError("calculator_error", f"expression is {len(expression)} characters long; the limit is {max_length}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError("calculator_error", f"cannot parse {expression!r}: {exc.msg}") from None
    max_bits = int(max_digits * 3.3219280948873626) + 1  # log2(10) bits per digit
    value = _evaluate(tree.body, max_digits, max_bits)
    if value.denominator == 1:
        return str(value.numerator)
    return format(float(value), ".12g")


def _check_size(value: Fraction, max_digits: int, max_bits: int) -> Fraction:
    if max(abs(value.numerator).bit_length(), value.denominator.bit_length()) > max_bits:
        raise ToolError("calculator_error", f"a number in the calculation has more than {max_digits} digits")
    return value


def _evaluate(node: ast.AST, max_digits: int, max_bits: int) -> Fraction:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int):
            raise ToolError("calculator_error", f"only integers are allowed, not {node.value!r}")
        return _check_size(Fraction(node.value), max_digits, max_bits)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand, max_digits, max_bits)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _evaluate(node.left, max_digits, max_bits)
        right = _evaluate(node.right, max_digits, max_bits)
        op = _BINARY[type(node.op)]
        if op in ("/", "//", "%") and right == 0:
            raise ToolError("calculator_error", "division by zero")
        if op == "**":
            if right.denominator != 1:
                raise ToolError("calculator_error", f"the exponent must be an integer, not {right}")
            if left == 0 and right < 0:
                raise ToolError("calculator_error", "division by zero (0 to a negative power)")
            # |result| has about |exponent| * bits(base) bits: refuse before computing it
            bits = max(abs(left.numerator).bit_length(), left.denominator.bit_length())
            if abs(left) != 1 and abs(right.numerator) * max(bits - 1, 1) > max_bits:
                raise ToolError("calculator_error", f"the result would have more than {max_digits} digits")
            return _check_size(left ** int(right), max_digits, max_bits)
        result = {"+": lambda: left + right, "-": lambda: left - right, "*": lambda: left * right,
                  "/": lambda: left / right, "//": lambda: Fraction(left // right), "%": lambda: left % right}[op]()
        return _check_size(result, max_digits, max_bits)
    raise ToolError("calculator_error", f"{type(node).__name__} is not allowed: use integers, + - * / // % ** "
                                        "and parentheses")


# --- the environment -------------------------------------------------------------------------------------

def _sandbox_answer(result) -> str:
    text = result.stdout
    if result.stderr:
        text = f"{text}\n{result.stderr}" if text else result.stderr
    return text.rstrip("\n")


@register_environment("tools")
class ToolEnvironment:
    """One episode of tool use; see the module docstring for the tools, the answers and the counters."""

    # Sandboxes running at once across the ToolEnvironments of the process that share a max_concurrent
    # (each sandbox is a process that may use a core until its limit): one semaphore per value.
    _slots: dict[int, threading.BoundedSemaphore] = {}
    _slots_lock = threading.Lock()
    observation_roles = ("tool",)  # its answers' chat role: validate_env checks the template renders it

    def __init__(self, tools: list[str] | tuple[str, ...] = TOOL_NAMES, limits: dict | None = None,
                 max_calls_per_turn: int = 4, calculator_max_digits: int = 1000, max_concurrent: int = 2) -> None:
        tools = list(tools)
        unknown = [t for t in tools if t not in TOOL_NAMES]
        if not tools or unknown:
            raise ValueError(f"env.kwargs.tools for 'tools' is {tools!r}; each must be one of {list(TOOL_NAMES)}")
        for name, value in (("max_calls_per_turn", max_calls_per_turn), ("calculator_max_digits", calculator_max_digits),
                            ("max_concurrent", max_concurrent)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"env.kwargs.{name} for 'tools' is {value!r}; it must be an integer >= 1")
        self.tools = tools
        self.limits = SandboxLimits.from_dict(limits, where="env.kwargs.limits")
        self.max_calls_per_turn = max_calls_per_turn
        self.calculator_max_digits = calculator_max_digits
        with ToolEnvironment._slots_lock:
            self._slot = ToolEnvironment._slots.setdefault(max_concurrent, threading.BoundedSemaphore(max_concurrent))
        self.schemas = [TOOL_SCHEMAS[t] for t in tools]

    async def reset(self, row: dict) -> str | None:
        return None

    async def close(self) -> None:
        return None

    async def step(self, action: str) -> EnvStep:
        calls = parse_tool_calls(action)
        if not calls:
            return EnvStep(observation=None, done=True, role="tool",
                           info={"tool_calls": 0, "tool_errors": 0, "tool_seconds": 0.0})
        started = time.perf_counter()
        messages, reasons = [], []
        for n, call in enumerate(calls, start=1):
            name = call.name if isinstance(call, ToolCall) else None
            try:
                if n > self.max_calls_per_turn:
                    raise ToolError("too_many_calls", f"tool call {n}: at most {self.max_calls_per_turn} calls per turn")
                if isinstance(call, ToolCallError):
                    raise ToolError(call.reason, call.message)
                content = await self._run(call)
            except ToolError as exc:
                reasons.append(exc.reason)
                content = f"error ({exc.reason}): {exc}"
            messages.append(tool_message(content, name))
        info = {"tool_calls": len(calls), "tool_errors": len(reasons), "tool_error_reason": reasons[0] if reasons else "",
                "tool_error_reasons": reasons, "tool_seconds": time.perf_counter() - started, "messages": messages}
        observation = "\n\n".join(m["content"] for m in messages)
        return EnvStep(observation=observation, reward=0.0, done=False, role="tool", info=info)

    async def _run(self, call: ToolCall) -> str:
        if call.name not in self.tools:
            raise ToolError("unknown_tool", f"tool {call.name!r} is not one of {self.tools}")
        key = _ARGUMENTS[call.name]
        if set(call.arguments) != {key}:
            raise ToolError("bad_arguments", f"{call.name} takes exactly one argument {key!r}, got {sorted(call.arguments)}")
        value = call.arguments[key]
        if not isinstance(value, str):
            raise ToolError("bad_arguments", f"{call.name}: {key!r} must be a string, got {type(value).__name__}")
        if call.name == "calculator":
            return calculate(value, self.calculator_max_digits)
        result = await asyncio.to_thread(self._sandboxed, value)
        if not result.ok:
            raise ToolError(result.reason, _sandbox_answer(result) or f"the run ended with {result.reason}")
        return _sandbox_answer(result)

    def _sandboxed(self, code: str):
        with self._slot:
            return run_python(code, self.limits)
