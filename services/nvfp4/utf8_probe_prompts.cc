// The probe's prompts. Each asks for a reply in the language's own script, so every answer is
// made of multi-byte characters (2 bytes: Cyrillic, Arabic; 3: Hangul, kana, Han, Tamil,
// Devanagari; 4: emoji), the byte lengths where a split or mis-scaled token shows first.
#include <nlohmann/json.hpp>

#include "services/nvfp4/utf8_probe.h"

namespace nq::nvfp4 {

const std::vector<ProbePrompt>& ProbePrompts() {
  static const std::vector<ProbePrompt> prompts = {
      {"korean", "서울의 가을 풍경을 한국어로 세 문장으로 설명해 주세요.", false},
      {"korean", "부산의 날씨를 lookup_place 도구로 찾아 주세요. 메모는 한국어로 남겨 주세요.", true},
      {"japanese", "京都の桜について、日本語で三文で説明してください。", false},
      {"japanese", "lookup_place ツールで札幌の天気を調べてください。メモは日本語でお願いします。", true},
      {"chinese", "请用中文写三句话介绍长城的历史。", false},
      {"chinese", "请用 lookup_place 工具查询成都的天气，备注用中文写。", true},
      {"tamil", "சென்னை நகரத்தைப் பற்றி தமிழில் மூன்று வாக்கியங்கள் எழுதுங்கள்.", false},
      {"tamil", "lookup_place கருவியைப் பயன்படுத்தி மதுரையின் வானிலையைக் கண்டறியவும்; குறிப்பை தமிழில் எழுதவும்.", true},
      {"arabic", "اكتب ثلاث جمل باللغة العربية عن مدينة القاهرة.", false},
      {"arabic", "استخدم أداة lookup_place لمعرفة طقس الإسكندرية، واكتب الملاحظة بالعربية.", true},
      {"russian", "Напишите три предложения по-русски о зиме в Москве.", false},
      {"russian", "Используйте инструмент lookup_place, чтобы узнать погоду в Новосибирске; заметку напишите по-русски.", true},
      {"hindi", "दिल्ली के बारे में हिंदी में तीन वाक्य लिखिए।", false},
      {"hindi", "lookup_place टूल से जयपुर का मौसम पता कीजिए; नोट हिंदी में लिखिए।", true},
      {"emoji", "Describe a sunny beach day using lots of emoji 🌞🏖️🌊🍦 in every sentence.", false},
      {"emoji", "Call lookup_place for Rio de Janeiro and put three emoji like 🎉🌴😀 in the note.", true},
      {"code_switching", "Explain in mixed English, 한국어, 日本語 and русский what a hash map is.", false},
      {"code_switching", "Call lookup_place for 東京 (Tokyo) and write the note in English mixed with 中文 and हिंदी.", true},
  };
  return prompts;
}

nlohmann::json ProbeTools() {
  return nlohmann::json::array({{{"type", "function"},
                                 {"function",
                                  {{"name", "lookup_place"},
                                   {"description", "Look up the weather of a city; the note is free text."},
                                   {"parameters",
                                    {{"type", "object"},
                                     {"properties",
                                      {{"city", {{"type", "string"}, {"description", "city name in any script"}}},
                                       {"note", {{"type", "string"}}}}},
                                     {"required", nlohmann::json::array({"city"})}}}}}}});
}

}  // namespace nq::nvfp4
