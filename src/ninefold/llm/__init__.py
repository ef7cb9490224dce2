"""ninefold.llm"""
