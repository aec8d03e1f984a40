"""Shaped like pytorch/examples `reinforcement_learning/reinforce.py`: one episode per step, actions
chosen with `action.item()` one time step at a time and the returns rebuilt on the host. A small
made-up environment stands in for gym's CartPole-v1 (no download, no gym)."""
from itertools import count

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.distributions import Categorical

GAMMA, LOG_INTERVAL, EPISODES = 0.99, 10, 6


class Pole:
    """Four numbers of state, two actions, an episode of at most 30 time steps."""

    reward_threshold = 475.0

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def reset(self):
        self.t = 0
        self.state = self.rng.uniform(-0.05, 0.05, 4)
        return self.state, {}

    def step(self, action):
        self.t += 1
        self.state = self.state + (0.01 if action else -0.01) + self.rng.normal(0, 0.01, 4)
        done = self.t >= 30 or abs(self.state[0]) > 0.2
        return self.state, 1.0, done, False, {}


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)
        self.saved_log_probs = []
        self.rewards = []

    def forward(self, x):
        x = F.relu(self.dropout(self.affine1(x)))
        return F.softmax(self.affine2(x), dim=1)


env = Pole(543)
torch.manual_seed(543)
policy = Policy()
optimizer = optim.Adam(policy.parameters(), lr=1e-2)
eps = np.finfo(np.float32).eps.item()


def select_action(state):
    state = torch.from_numpy(state).float().unsqueeze(0)
    probs = policy(state)
    m = Categorical(probs)
    action = m.sample()
    policy.saved_log_probs.append(m.log_prob(action))
    return action.item()


def finish_episode():
    R = 0
    policy_loss = []
    returns = []
    for r in policy.rewards[::-1]:
        R = r + GAMMA * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + eps)
    for log_prob, R in zip(policy.saved_log_probs, returns):
        policy_loss.append(-log_prob * R)
    optimizer.zero_grad()
    policy_loss = torch.cat(policy_loss).sum()
    policy_loss.backward()
    optimizer.step()
    del policy.rewards[:]
    del policy.saved_log_probs[:]


def main():
    running_reward = 10
    for i_episode in count(1):
        state, _ = env.reset()
        ep_reward = 0
        for t in range(1, 10000):
            action = select_action(state)
            state, reward, done, _, _ = env.step(action)
            policy.rewards.append(reward)
            ep_reward += reward
            if done:
                break
        running_reward = 0.05 * ep_reward + (1 - 0.05) * running_reward
        finish_episode()
        if i_episode % LOG_INTERVAL == 0:
            print(f"Episode {i_episode}\tLast reward: {ep_reward:.2f}\tAverage reward: {running_reward:.2f}")
        if running_reward > env.reward_threshold or i_episode >= EPISODES:
            break


if __name__ == "__main__":
    main()
