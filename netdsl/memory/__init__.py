"""netdsl.memory"""
