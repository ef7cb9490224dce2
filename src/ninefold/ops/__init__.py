"""ninefold.ops"""
