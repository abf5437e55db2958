"""Text in and out: the tokenizers (tokenizer.py, pretokenizers.py), the chat
template (chat.py), the prompt a generation starts from (prompt.py), llama.cpp's
command-line escapes (escapes.py)."""
