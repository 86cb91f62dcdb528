"""Chat: conversations in, prompt ids out; output text in, content / reasoning / tool calls out.

A layer of its own between `engine/runtime` and `engine/service` (it imports the model's
tokenizers and the runtime's grammar and request types; the service's API edges import it):

  markup.py             each family's markup, defined once (Kimi K2, DeepSeek V3/V3.1, Qwen3,
                        Llama 3 JSON); rendering, parsing and constraining read it
  template.py           the checkpoint's jinja chat template (as transformers renders it)
  messages.py           OpenAI-shaped messages validated and shaped for templates; other
                        clients' tool-call ids as Kimi's
  tool_declaration_ts.py  Kimi K2.5's TypeScript tool declarations
  reasoning.py          the reasoning splitter (every API, text and token ids)
  parser_base.py, parsers.py  streaming tool-call parsers, one per family
  grammars.py           tool-call grammars (tool_choice required / named) as Lark text
  thinking.py           thinking on/off and budgets from every API's fields
  stream.py             one choice's output: deltas, tool calls, reasoning tokens, finish reason
"""
