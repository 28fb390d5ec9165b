// `troupe deploy check|render` as a user runs them: exit status, messages on
// stderr, and nothing written for a bad manifest.
#include <gtest/gtest.h>

#include <filesystem>

#include "tests/deploy/test_util.hpp"
#include "tests/support/process.hpp"

namespace troupe::deploy {
namespace {

using testing::run_command;
using testing::TempDir;
using testing::troupe_binary;
using test::source;

TEST(DeployCli, check_accepts_every_example) {
  for (const auto& f : test::files_in("deploy/examples")) {
    auto r = run_command(troupe_binary() + " deploy check --manifest " + f);
    EXPECT_EQ(r.status, 0) << f << "\n" << r.err;
    EXPECT_NE(r.out.find(f + ": ok: topology '"), std::string::npos) << r.out;
    EXPECT_EQ(r.err, "");
  }
}

TEST(DeployCli, check_rejects_each_bad_manifest_with_its_line_and_nothing_else_happens) {
  for (const auto& f : test::files_in("tests/deploy/bad")) {
    auto r = run_command(troupe_binary() + " deploy check --manifest " + f);
    EXPECT_EQ(r.status, 1) << f << "\n" << r.err;
    EXPECT_EQ(r.out, "") << f;
    EXPECT_NE(r.err.find(f + ":" + test::expectation(f)), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("troupe: error: " + f + ": "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("nothing was started or written"), std::string::npos) << r.err;
  }
}

TEST(DeployCli, render_of_a_bad_manifest_writes_nothing) {
  TempDir tmp;
  const std::string out = tmp.path() + "/objects";
  for (const auto& f : test::files_in("tests/deploy/bad")) {
    auto r = run_command(troupe_binary() + " deploy render --target k8s --manifest " + f + " --out " + out);
    EXPECT_EQ(r.status, 1) << f << "\n" << r.err;
    EXPECT_EQ(r.out, "") << f;
    EXPECT_FALSE(std::filesystem::exists(out)) << f;
  }
}

TEST(DeployCli, render_writes_one_file_per_object_and_a_kustomization) {
  TempDir tmp;
  const std::filesystem::path out = tmp.path() + "/objects";
  auto r = run_command(troupe_binary() + " deploy render --target k8s --manifest " +
                       source("deploy/examples/disaggregated-1p1d.yaml") + " --out " + out.string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(out / "kustomization.yaml"));
  EXPECT_TRUE(std::filesystem::exists(out / "statefulset-troupe-decode.yaml"));
  EXPECT_TRUE(std::filesystem::exists(out / "networkpolicy-troupe-gateway.yaml"));
  size_t n = 0;
  for ([[maybe_unused]] auto& e : std::filesystem::directory_iterator(out)) ++n;
  EXPECT_EQ(n, 14u);  // 13 objects + kustomization.yaml
}

TEST(DeployCli, check_node_names_the_instance_and_its_required_peers) {
  const std::string m = source("deploy/examples/three-host.yaml");
  auto r = run_command(troupe_binary() + " deploy check --manifest " + m + " --node decode");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("decode-0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("10.77.0.3:7400"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("ready when connected to: front-0"), std::string::npos) << r.out;
  auto missing = run_command(troupe_binary() + " deploy check --manifest " + m + " --node decode-1");
  EXPECT_EQ(missing.status, 1) << missing.err;
  EXPECT_NE(missing.err.find("no node instance 'decode-1' (instances: front-0 prefill-0 decode-0)"), std::string::npos)
      << missing.err;
}

TEST(DeployCli, render_rejects_an_unknown_target) {
  auto r = run_command(troupe_binary() + " deploy render --target nomad --manifest " +
                       source("deploy/examples/colocated.yaml"));
  EXPECT_NE(r.status, 0);
  EXPECT_EQ(r.out, "");
}

}  // namespace
}  // namespace troupe::deploy
