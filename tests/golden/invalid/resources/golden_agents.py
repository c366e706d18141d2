"""Agent programs the golden flows name (read by `flowrl check`, never run)."""


async def run(client, row):
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return reply.choices[0].message.content


async def no_row(client):
    return ""
