"""Tools, whichever API sends them: what every API checks in a tool it is sent and how
a call is forced (specs.py), the calls read back from the generated text (calls.py),
streamed in pieces (tools/tools/call_stream.py), and the raw-text arguments of Qwen3.5/3.6's XML
calls (xml_arguments.py)."""
