// The watchdog: fires once after the timeout with the current operation's label, never while
// heartbeats come, never when off. The abort is injected, so nothing ends the test process.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>

#include "tessera/parallel/watchdog.hpp"

namespace tessera {
namespace {

using namespace std::chrono_literals;

/// Records the message the watchdog hands over instead of ending the process.
struct Recorder {
  std::promise<std::string> message;
  std::future<std::string> future = message.get_future();
  Watchdog::OnHang callback() {
    return [this](const std::string& m) { message.set_value(m); };
  }
};

TEST(Watchdog, FiresAfterTheTimeoutNamingTheOperation) {
  Recorder recorder;
  const auto start = std::chrono::steady_clock::now();
  Watchdog watchdog(0.2, 7, recorder.callback());
  const WatchdogScope scope(&watchdog, "gradient allreduce (bucket 2 of 3)");
  ASSERT_EQ(recorder.future.wait_for(10s), std::future_status::ready) << "the watchdog never fired";
  EXPECT_GE(std::chrono::steady_clock::now() - start, 200ms);
  const std::string message = recorder.future.get();
  EXPECT_EQ(message.rfind("tessera: error: [rank 7] no training step for ", 0), 0u) << message;
  EXPECT_NE(message.find("; this rank is stuck in: gradient allreduce (bucket 2 of 3)"), std::string::npos) << message;
  EXPECT_TRUE(watchdog.fired());
}

TEST(Watchdog, DoesNotFireWhileHeartbeatsCome) {
  Recorder recorder;
  Watchdog watchdog(0.5, 0, recorder.callback());
  for (int i = 0; i < 75; ++i) {  // 1.5 s, three timeouts, a heartbeat every 20 ms
    watchdog.heartbeat();
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_FALSE(watchdog.fired());
  EXPECT_EQ(recorder.future.wait_for(0s), std::future_status::timeout);
  // Once they stop, it fires; outside any scope it says so.
  ASSERT_EQ(recorder.future.wait_for(10s), std::future_status::ready) << "the watchdog never fired";
  EXPECT_NE(recorder.future.get().find(Watchdog::kNoOperation), std::string::npos);
}

TEST(Watchdog, OffWhenTheTimeoutIsZero) {
  Recorder recorder;
  Watchdog watchdog(0, 0, recorder.callback());
  EXPECT_FALSE(watchdog.enabled());
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(watchdog.fired());
  EXPECT_EQ(recorder.future.wait_for(0s), std::future_status::timeout);
}

TEST(Watchdog, ScopesNestAndRestore) {
  Watchdog watchdog(0, 0, nullptr);
  EXPECT_EQ(watchdog.operation(), nullptr);
  {
    const WatchdogScope outer(&watchdog, "validation");
    {
      const WatchdogScope inner(&watchdog, "validation (loss allreduce)");
      EXPECT_STREQ(watchdog.operation(), "validation (loss allreduce)");
    }
    EXPECT_STREQ(watchdog.operation(), "validation");
  }
  EXPECT_EQ(watchdog.operation(), nullptr);
  const WatchdogScope none(nullptr, "ignored");  // a null watchdog is a no-op
}

TEST(Watchdog, StopsPromptlyWhenDestroyed) {
  const auto start = std::chrono::steady_clock::now();
  { Watchdog watchdog(600, 0, [](const std::string&) { ADD_FAILURE() << "fired"; }); }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

}  // namespace
}  // namespace tessera
