"""ninefold.dsl"""
