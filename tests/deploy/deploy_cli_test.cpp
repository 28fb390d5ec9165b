// `troupe deploy check|render` as a user runs them: exit status, messages,
// and nothing written for a bad manifest.
#include <gtest/gtest.h>

#include <filesystem>

#include "tests/deploy/test_util.hpp"

namespace troupe::deploy {
namespace {

using test::run_troupe;
using test::source;

TEST(DeployCli, check_accepts_every_example) {
  for (const auto& f : test::files_in("deploy/examples")) {
    auto r = run_troupe("deploy check --manifest " + f);
    EXPECT_EQ(r.status, 0) << f << "\n" << r.output;
    EXPECT_NE(r.output.find(": ok: topology '"), std::string::npos) << r.output;
  }
}

TEST(DeployCli, check_rejects_each_bad_manifest_with_its_line_and_nothing_else_happens) {
  for (const auto& f : test::files_in("tests/deploy/bad")) {
    auto r = run_troupe("deploy check --manifest " + f);
    EXPECT_EQ(r.status, 1) << f << "\n" << r.output;
    EXPECT_NE(r.output.find(f + ":" + test::expectation(f)), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("troupe: error: " + f + ": "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("nothing was started or written"), std::string::npos) << r.output;
  }
}

TEST(DeployCli, render_of_a_bad_manifest_writes_nothing) {
  const auto out = std::filesystem::temp_directory_path() / "troupe_deploy_cli_bad_render";
  std::filesystem::remove_all(out);
  for (const auto& f : test::files_in("tests/deploy/bad")) {
    auto r = run_troupe("deploy render --target k8s --manifest " + f + " --out " + out.string());
    EXPECT_EQ(r.status, 1) << f << "\n" << r.output;
    EXPECT_FALSE(std::filesystem::exists(out)) << f;
  }
}

TEST(DeployCli, render_writes_one_file_per_object_and_a_kustomization) {
  const auto out = std::filesystem::temp_directory_path() / "troupe_deploy_cli_render";
  std::filesystem::remove_all(out);
  auto r = run_troupe("deploy render --target k8s --manifest " + source("deploy/examples/disaggregated-1p1d.yaml") +
                      " --out " + out.string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(std::filesystem::exists(out / "kustomization.yaml"));
  EXPECT_TRUE(std::filesystem::exists(out / "statefulset-troupe-decode.yaml"));
  EXPECT_TRUE(std::filesystem::exists(out / "networkpolicy-troupe-gateway.yaml"));
  size_t n = 0;
  for ([[maybe_unused]] auto& e : std::filesystem::directory_iterator(out)) ++n;
  EXPECT_EQ(n, 14u);  // 13 objects + kustomization.yaml
  std::filesystem::remove_all(out);
}

TEST(DeployCli, check_node_names_the_instance_and_its_required_peers) {
  const std::string m = source("deploy/examples/three-host.yaml");
  auto r = run_troupe("deploy check --manifest " + m + " --node decode");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("decode-0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("10.77.0.3:7400"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ready when connected to: front-0"), std::string::npos) << r.output;
  auto missing = run_troupe("deploy check --manifest " + m + " --node decode-1");
  EXPECT_EQ(missing.status, 1) << missing.output;
  EXPECT_NE(missing.output.find("no node instance 'decode-1' (instances: front-0 prefill-0 decode-0)"), std::string::npos)
      << missing.output;
}

TEST(DeployCli, render_rejects_an_unknown_target) {
  auto r = run_troupe("deploy render --target nomad --manifest " + source("deploy/examples/colocated.yaml"));
  EXPECT_NE(r.status, 0) << r.output;
}

}  // namespace
}  // namespace troupe::deploy
