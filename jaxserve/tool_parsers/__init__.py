"""Tool calling: the parsers of each model's call format (hermes, llama3_json, mistral) behind one
interface (base.ToolParser), and plan_tools, what a request's tools change (plan.py)."""

from jaxserve.tool_parsers.base import ParsedToolCalls, StreamDelta, ToolCall, ToolCallDelta, ToolParser
from jaxserve.tool_parsers.plan import (NO_TOOLS, FunctionTool, ToolChoice, ToolError, ToolPlan, function_tools,
                                        plan_tools, resolve_tool_parser, template_takes_tools,
                                        tool_calls_constraint)
from jaxserve.tool_parsers.registry import TOOL_PARSERS, default_tool_parser, tool_parser

__all__ = ["FunctionTool", "NO_TOOLS", "ParsedToolCalls", "StreamDelta", "TOOL_PARSERS", "ToolCall",
           "ToolCallDelta", "ToolChoice", "ToolError", "ToolParser", "ToolPlan", "default_tool_parser",
           "function_tools", "plan_tools", "resolve_tool_parser", "template_takes_tools",
           "tool_calls_constraint", "tool_parser"]
