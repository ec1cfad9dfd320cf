"""Writes conversations.json (run once by hand; the JSON is what is committed and read).

Kept as a script so the escapes in the arguments below stay readable."""
import json

W = {"name": "get_weather", "description": "Current weather for a city. 城市天气。",
     "parameters_json": json.dumps({"type": "object", "properties": {
         "city": {"type": "string", "description": "City name, e.g. 北京"},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
         "required": ["city"]}, ensure_ascii=False)}
S = {"name": "search_docs", "description": "Search the docs.",
     "parameters_json": json.dumps({"type": "object", "properties": {
         "query": {"type": "string"},
         "filters": {"type": "object", "properties": {
             "tags": {"type": "array", "items": {"type": "string"}},
             "since": {"type": ["string", "null"], "format": "date"}}},
         "limit": {"type": "number", "default": 10.5}},
         "required": ["query"], "additionalProperties": False})}
NODESC = {"name": "ping", "description": "", "parameters_json": ""}

def call(i, name, args):
    return {"id": f"call_{i}", "name": name,
            "arguments_json": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}

def u(t): return {"role": "user", "content": t}
def s(t): return {"role": "system", "content": t}
def a(t, **kw): return dict({"role": "assistant", "content": t}, **kw)
def tool(cid, t, name=""):
    m = {"role": "tool", "content": t, "tool_call_id": cid}
    if name: m["name"] = name
    return m

cases = []
def case(name, messages, agp=True, tools=(), enable_thinking=None, expect_error=None, note=None):
    c = {"name": name, "chat": {"messages": messages, "tools": list(tools), "add_generation_prompt": agp}}
    if enable_thinking is not None:
        c["chat"]["enable_thinking"] = enable_thinking
    if expect_error:
        # Our contract (RenderChat), per model: the error message part tests look for.
        c["expect_error"] = (expect_error if isinstance(expect_error, dict)
                             else {"glm5": expect_error, "deepseek_v3": expect_error})
    if note:
        c["note"] = note
    cases.append(c)

case("system_user", [s("You are a helpful assistant."), u("Hello!")])
case("user_only_no_generation_prompt", [u("Hello!")], agp=False)
case("multi_turn", [s("Be brief."), u("Hi"), a("Hello! How can I help?"), u("What is 2+2?"), a("4."), u("And 3+3?")])
case("multi_turn_ends_with_assistant", [u("Hi"), a("Hello!")], agp=False)
case("two_system_messages", [s("First rule."), u("Hi"), s("Second rule."), u("Again")])
case("reasoning_last_turn", [u("Why is the sky blue?"), a("Rayleigh scattering.", reasoning_content="Short wavelengths scatter more.")], agp=False)
case("reasoning_in_history", [u("Why is the sky blue?"), a("Rayleigh scattering.", reasoning_content="Short wavelengths scatter more."), u("And sunsets?")])
case("reasoning_inline_in_content", [u("Q"), a("<think>\nLet me think.\n</think>\n\nThe answer.")], agp=False)
case("reasoning_inline_no_open_tag", [u("Q"), a("Just thinking\n\n</think>\n\nAnswer after.")], agp=False)
case("reasoning_whitespace", [u("Q"), a("\n\n  answer with spaces \u3000\n", reasoning_content=" \n\u00a0 thought \t\n")], agp=False)
case("reasoning_empty_string_means_absent", [u("Q"), a("visible</think>tail", reasoning_content="")], agp=False)
case("reasoning_only_whitespace", [u("Q"), a("A", reasoning_content="  \n ")], agp=False)
case("tools_defined", [s("You can use tools."), u("Weather in Paris?")], tools=[W, S])
case("tool_without_description_or_parameters", [u("ping it")], tools=[NODESC])
case("tool_call_single", [u("Weather in Paris?"), a("", tool_calls=[call(1, "get_weather", {"city": "Paris", "unit": "celsius"})]),
                          tool("call_1", '{"temp": 21, "sky": "clear"}', "get_weather")], tools=[W])
case("tool_calls_several", [
    u("Compare the weather in 北京 and Zürich, and search the docs."),
    a("", tool_calls=[
        call(1, "get_weather", {"city": "北京", "days": 3}),
        call(2, "get_weather", {"city": "Zürich", "unit": "fahrenheit"}),
        call(3, "search_docs", {"query": "say \"hi\"\nnew line \\ back\tslash \u0001 ctl",
                               "filters": {"tags": ["a", "β", "😀"], "since": None},
                               "limit": 2.5, "exact": True, "empty": {}, "list": [], "nested": [[1, 2], {"k": [False]}]})]),
    tool("call_1", "晴，25°C"), tool("call_2", "Cloudy, 12°F"), tool("call_3", "[]"),
    a("北京 is sunny; Zürich is cloudy. No docs found."),
    u("Thanks! 🙏")], tools=[W, S])
case("tool_call_with_content", [u("Weather in Rome?"), a("Let me check that for you.", tool_calls=[call(1, "get_weather", {"city": "Rome"})]),
                                tool("call_1", "sunny")], tools=[W],
     note="DeepSeek-V3's template drops tool calls of a message whose content is not empty.")
case("two_tool_rounds", [
    u("Weather in Oslo?"), a("", tool_calls=[call(1, "get_weather", {"city": "Oslo"})]), tool("call_1", "snow"),
    a("It is snowing in Oslo."), u("And Lima?"),
    a("", tool_calls=[call(2, "get_weather", {"city": "Lima"}), call(3, "get_weather", {"city": "Lima", "days": 2})]),
    tool("call_2", "fog"), tool("call_3", "fog, then sun"), a("Foggy in Lima.")], agp=False, tools=[W])
case("tool_call_with_reasoning", [u("Weather in Cairo?"),
    a("", reasoning_content="The user wants the weather; call the tool.", tool_calls=[call(1, "get_weather", {"city": "Cairo"})]),
    tool("call_1", "hot")], tools=[W])
case("tool_result_last_no_generation_prompt", [u("Weather in Paris?"), a("", tool_calls=[call(1, "get_weather", {"city": "Paris"})]),
                                               tool("call_1", "rain")], agp=False, tools=[W])
case("tool_call_string_values_look_like_json", [u("go"), a("", tool_calls=[call(1, "search_docs", {"query": "42", "limit": 42, "flag": "true", "obj": "{\"a\": 1}"})]),
                                                tool("call_1", "ok")], tools=[S])
case("tool_call_numbers", [u("go"), a("", tool_calls=[call(1, "search_docs",
     '{"a": 1.5, "b": 1e-7, "c": 1e16, "d": 100.0, "e": -0.0, "f": 12345678901234567, "g": 1E2, "h": 0.1, "i": "\\u00e9\\ud83d\\ude00", "j": -7}')]),
     tool("call_1", "ok")], tools=[S])
case("tool_call_empty_arguments", [u("ping"), a("", tool_calls=[call(1, "ping", "{}")]), tool("call_1", "pong")], tools=[NODESC])
case("tool_call_spaced_arguments_json", [u("go"), a("", tool_calls=[call(1, "get_weather", '{\n  "city" : "Paris" ,\n  "days":2\n}')]),
                                         tool("call_1", "ok")], tools=[W])
case("enable_thinking_false", [u("Quick answer please.")], enable_thinking=False)
case("enable_thinking_true", [u("Think hard.")], enable_thinking=True)
case("enable_thinking_false_no_generation_prompt", [u("Hi"), a("Hello", reasoning_content="r")], agp=False, enable_thinking=False)
case("multilingual", [s("Réponds en français, 日本語も可。"), u("مرحبا! Привет! 你好！こんにちは 👋🏽 e\u0301"),
                      a("Bonjour ! Здравствуйте ! 你好！"), u("한국어로 말해 주세요.")])
case("empty_contents", [s(""), u(""), a(""), u("")])
case("special_text_in_content", [u("Literal <|user|> and <think>x</think> and {{ braces }} {% raw %} <｜User｜>"),
                                 a("Echo: <tool_call>not a call</tool_call>")], agp=False)
case("leading_tool_message", [tool("call_9", "orphan result"), u("hi")],
     expect_error="tool message without a preceding assistant tool call")
case("unknown_role", [{"role": "developer", "content": "x"}, u("hi")], expect_error="unknown role")
case("glm_arguments_not_an_object", [u("go"), a("", tool_calls=[call(1, "get_weather", "[1, 2]")]), tool("call_1", "x")],
     tools=[W], expect_error={"glm5": "arguments are not a JSON object"},
     note="DeepSeek-V3's template pastes arguments_json verbatim, so any text renders.")
case("arguments_not_json", [u("go"), a("", tool_calls=[call(1, "get_weather", "{city: Paris}")]), tool("call_1", "x")],
     tools=[W], expect_error={"glm5": "arguments are not valid JSON"},
     note="DeepSeek-V3's template pastes arguments_json verbatim, so any text renders.")

with open("conversations.json", "w", encoding="utf-8") as f:
    json.dump({"schema": "nq.chat.conversations/1", "cases": cases}, f, ensure_ascii=False, indent=1)
    f.write("\n")
print(len(cases), "cases")
