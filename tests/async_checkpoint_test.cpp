// AsyncCheckpointer (state/async_checkpoint.h), the writer thread of train.checkpoint_async: one
// save in flight at a time (a second one waits for the first, and cannot be started or given the
// snapshot buffers before), a failed save's error comes back at the next check, the end of its
// scope lets the save finish, and an exception unwinding past it abandons the save instead; the
// buffers reserved on the writer thread are the ones the saves then use.
#include "state/async_checkpoint.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <stdexcept>
#include <thread>

#include "kernels/backend.h"

namespace kiln {
namespace {

using namespace std::chrono_literals;

TEST(AsyncCheckpointer, ASecondSaveWaitsForTheFirst) {
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  AsyncCheckpointer writer(*cpu);
  float* buffer = writer.snapshot_buffer(0, 100);
  ASSERT_NE(buffer, nullptr);
  EXPECT_EQ(writer.snapshot_bytes(), 3 * 100 * sizeof(float));
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<int> jobs_done{0};
  writer.start([&, released](const std::function<bool()>&) {
    released.wait();
    ++jobs_done;
  });
  // While it is in flight, the next save can neither start nor have the buffers it reads.
  EXPECT_THROW(writer.start([](const std::function<bool()>&) {}), std::logic_error);
  EXPECT_THROW(writer.snapshot_buffer(0, 100), std::logic_error);
  std::future<double> waited = std::async(std::launch::async, [&] { return writer.wait(); });
  EXPECT_EQ(waited.wait_for(200ms), std::future_status::timeout) << "wait() did not wait";
  EXPECT_EQ(jobs_done, 0);
  release.set_value();
  EXPECT_GE(waited.get(), 150.0);
  EXPECT_EQ(jobs_done, 1);
  // Once it is written, the same buffer serves the next save.
  EXPECT_EQ(writer.snapshot_buffer(0, 100), buffer);
  EXPECT_THROW(writer.snapshot_buffer(0, 99), std::logic_error);
  writer.start([&](const std::function<bool()>&) { ++jobs_done; });
  std::string error = "unset";
  EXPECT_GE(writer.wait(&error), 0.0);
  EXPECT_EQ(error, "");
  EXPECT_EQ(jobs_done, 2);
}

TEST(AsyncCheckpointer, ReservedBuffersServeTheSaves) {
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  AsyncCheckpointer writer(*cpu);
  writer.reserve({100, 50}, false);
  // The reservation is the writer's job: a save waits for it like for a save in flight.
  EXPECT_GE(writer.wait(), 0.0);
  EXPECT_EQ(writer.snapshot_bytes(), 3 * 150 * sizeof(float));
  float* first = writer.snapshot_buffer(0, 100);
  float* second = writer.snapshot_buffer(1, 50);
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(writer.snapshot_bytes(), 3 * 150 * sizeof(float)) << "a save allocated again";
  EXPECT_EQ(writer.snapshot_buffer(0, 100), first);
  EXPECT_THROW(writer.snapshot_buffer(1, 49), std::logic_error);
}

TEST(AsyncCheckpointer, AFailedSaveIsReportedAtEveryLaterWait) {
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  AsyncCheckpointer writer(*cpu);
  writer.start([](const std::function<bool()>&) {
    throw std::runtime_error("checkpoint step 6 failed on rank 0: No space left on device");
  });
  try {
    writer.wait();
    FAIL() << "wait() returned after a failed save";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "checkpoint step 6 failed on rank 0: No space left on device");
  }
  // The error stays: every later wait reports it, thrown or stored.
  EXPECT_THROW(writer.wait(), std::runtime_error);
  std::string error;
  EXPECT_GE(writer.wait(&error), 0.0);
  EXPECT_EQ(error, "checkpoint step 6 failed on rank 0: No space left on device");
}

TEST(AsyncCheckpointer, TheEndOfItsScopeLetsTheSaveFinish) {
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::atomic<bool> finished{false}, saw_abandoned{false};
  {
    AsyncCheckpointer writer(*cpu);
    writer.start([&](const std::function<bool()>& abandoned) {
      std::this_thread::sleep_for(100ms);
      saw_abandoned = abandoned();
      finished = true;
    });
  }
  EXPECT_TRUE(finished);
  EXPECT_FALSE(saw_abandoned);
}

TEST(AsyncCheckpointer, AnExceptionUnwindingPastItAbandonsTheSave) {
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::atomic<bool> saw_abandoned{false};
  const auto begin = std::chrono::steady_clock::now();
  try {
    AsyncCheckpointer writer(*cpu);
    // A save that waits for a rank that will never write (rank 0 waiting on a dead peer).
    writer.start([&](const std::function<bool()>& abandoned) {
      const auto give_up = std::chrono::steady_clock::now() + 20s;
      while (!abandoned() && std::chrono::steady_clock::now() < give_up)
        std::this_thread::sleep_for(1ms);
      saw_abandoned = abandoned();
    });
    throw std::runtime_error("a collective failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_TRUE(saw_abandoned);
  EXPECT_LT(std::chrono::steady_clock::now() - begin, 10s);
}

}  // namespace
}  // namespace kiln
